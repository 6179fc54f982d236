//! One error type for a run; every variant names the option, file or checkpoint at fault.

use std::path::PathBuf;

/// Errors of configuring, running, checkpointing and resuming a training run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option (config key or `--flag`) is unknown, unparsable or out of range.
    #[error("option `{name}`: {message}")]
    Option { name: String, message: String },
    /// An option or key that does not exist.
    #[error("unknown {what} (known: {known})")]
    Unknown { what: String, known: String },
    /// A config file could not be parsed (toml's message gives the line and the key).
    #[error("{file}: {message}")]
    ConfigFile { file: PathBuf, message: String },
    /// A file or folder could not be read or written.
    #[error("{file}: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    /// A checkpoint is incomplete, corrupt or does not match the run.
    #[error("checkpoint {dir}: {message}")]
    Checkpoint { dir: PathBuf, message: String },
    /// A training step failed.
    #[error("step {step}: {message}")]
    Step { step: usize, message: String },
    /// Several processes could not join, or one of them failed or went silent (the message names
    /// the ranks).
    #[error("process group: {0}")]
    Group(String),
    /// A data-parallel worker (`who`: "drafter worker 1", "drafter workers [0, 2]") failed or
    /// went silent.
    #[error("{who}: {message}")]
    Worker { who: String, message: String },
    /// The run stopped on non-finite losses or gradients.
    #[error("{0}")]
    NonFinite(String),
    /// The reference crate (drafter, data, optimizer) failed.
    #[error(transparent)]
    Reference(#[from] dflash_reference::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The optimized step (GPU driver, memory, shapes) failed.
    #[error(transparent)]
    Optimized(#[from] dflash_optimized::Error),
}

/// Result with the trainer's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An option `name` with a bad value.
    pub fn option(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Option { name: name.into(), message: message.into() }
    }

    /// Worker `who` failed with `message`.
    pub fn worker(who: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Worker { who: who.into(), message: message.into() }
    }

    /// An I/O error on `file`.
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }

    /// A problem with the checkpoint in `dir`.
    pub fn checkpoint(dir: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Checkpoint { dir: dir.into(), message: message.into() }
    }
}

/// The message a panic carried (a thread's, caught so that it becomes the run's error).
pub fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|m| m.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
