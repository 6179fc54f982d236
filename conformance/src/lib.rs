//! The conformance suite's harnesses: named tolerances, relative errors, fixture paths, random
//! tiny setups, the attention and target cases, the counting allocator, and the GPU checks that
//! `xtask gpu-conformance` runs on the H200. The tests themselves live in `tests/`.

pub mod attention_cases;
pub mod decode_cases;
pub mod gdn_cases;
pub mod gpu_attention;
pub mod gpu_step;
pub mod heap;
pub mod hybrid_cases;
pub mod op_cases;
pub mod setups;
pub mod target_cases;
pub mod tolerance;
pub mod twin_tensors;

use std::path::PathBuf;

/// The repository's `fixtures/` folder: where this crate was built, else `fixtures/` of the
/// working directory (a bundled binary run from a checkout elsewhere, as on the GPU machine).
pub fn fixtures_dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    match built.is_dir() {
        true => built,
        false => PathBuf::from("fixtures"),
    }
}

/// A command line of `base` then `extra`, without the options of `base` that `extra` gives again
/// (`--max-len` and `--max_len` alike; `--data`, which adds files, is kept): the CLIs refuse an
/// option given twice, and a test's extra options replace its defaults.
pub fn cli_args<S: AsRef<str>>(base: &[S], extra: &[&str]) -> Vec<String> {
    let name = |arg: &str| arg.strip_prefix("--").map(|n| n.replace('-', "_"));
    let replaced: Vec<String> = extra.iter().filter_map(|a| name(a)).filter(|n| n != "data").collect();
    let mut out = Vec::new();
    let mut keep = true;
    for arg in base.iter().map(AsRef::as_ref) {
        if let Some(n) = name(arg) {
            keep = !replaced.contains(&n);
        }
        if keep {
            out.push(arg.to_string());
        }
    }
    out.extend(extra.iter().map(|a| a.to_string()));
    out
}
