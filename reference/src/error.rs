//! One error type for the reference crate. Every variant names the file, field or tensor at fault.

use std::path::PathBuf;

/// Errors of loading, validating and running the reference.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{file}: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    /// A JSON file is not valid JSON.
    #[error("{file}: invalid JSON at line {line}, column {column}: {message}")]
    Json { file: PathBuf, line: usize, column: usize, message: String },
    /// A config field is missing, has the wrong type, or an unsupported / inconsistent value.
    #[error("{file}: field `{field}`: {message}")]
    Field { file: PathBuf, field: String, message: String },
    /// A weight tensor is missing, has the wrong shape or an unsupported dtype.
    #[error("{file}: tensor `{tensor}`: {message}")]
    Tensor { file: PathBuf, tensor: String, message: String },
    /// An argument of a reference function is out of its domain (names the argument).
    #[error("invalid `{what}`: {message}")]
    Invalid { what: String, message: String },
    /// An error of the tensor library.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result with the reference crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An out-of-domain argument `what`.
    pub fn invalid(what: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Invalid { what: what.into(), message: message.into() }
    }

    /// An I/O error on `file`.
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }
}
