//! The optimized crate's error: the reference's errors (files, fields, tensors, arguments), and
//! what only the production path can hit: the GPU driver, compiler or a launch, and memory.

/// Errors of the optimized path; every variant names the operation, buffer or argument at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Reference(#[from] dflash_reference::Error),
    /// A GPU driver, compiler or launch error (names the operation).
    #[error("GPU: {0}")]
    Gpu(String),
    /// A plan that does not fit, or an allocation that failed (names what and how much).
    #[error("memory: {0}")]
    Memory(String),
    /// A loss or gradient that is NaN or Inf: `what` names the tensor (a training loop skips
    /// the step and counts it).
    #[error("{what}: {message}")]
    NonFinite { what: String, message: String },
}

/// Result with the optimized crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An out-of-domain argument `what`.
    pub fn invalid(what: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Reference(dflash_reference::Error::invalid(what, message))
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Reference(e.into())
    }
}

/// For the reference's training loop, which takes gradients from an optimized step: GPU and
/// memory errors become invalid-argument errors naming their kind.
impl From<Error> for dflash_reference::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Reference(e) => e,
            Error::Gpu(m) => dflash_reference::Error::invalid("GPU", m),
            Error::Memory(m) => dflash_reference::Error::invalid("memory", m),
            Error::NonFinite { what, message } => dflash_reference::Error::invalid(what, message),
        }
    }
}
