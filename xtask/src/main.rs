//! `cargo xtask <command>`: the project's developer workflows.
//!
//! - `train`: train a drafter; with no arguments, a tiny drafter against the tiny built-in
//!   target on the CPU (a few minutes), printing the falling loss and tau before and after.

mod args;
mod train;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <command> [options]

commands:
  train    train a drafter (no options: the tiny built-in default on the CPU)
           run `cargo xtask train --help` for its options";

fn main() -> ExitCode {
    let mut argv = std::env::args().skip(1);
    let result = match argv.next().as_deref() {
        Some("train") => train::run(argv.collect()),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
