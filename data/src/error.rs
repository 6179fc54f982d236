//! One error type for the data pipeline. Every variant names the file (and the line or field)
//! at fault; problems of a single conversation are [`Skip`]s, counted in the summary instead.

use std::fmt;
use std::path::PathBuf;

/// Errors that stop the pipeline: unreadable files, a bad tokenizer or template, bad options,
/// a data set with nothing left to train on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened, read or written.
    #[error("{file}: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    /// A file of the target folder or the cache is present but unusable (names the field).
    #[error("{file}: {field}: {message}")]
    Field { file: PathBuf, field: String, message: String },
    /// The chat template does not compile.
    #[error("{file}: chat template: {message}")]
    Template { file: PathBuf, message: String },
    /// An option is out of its domain.
    #[error("option `{option}`: {message}")]
    Option { option: String, message: String },
    /// Every conversation was skipped or filtered; names the reasons and their counts.
    #[error("no training rows: {0}")]
    NoRows(String),
}

/// Result with the data crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An I/O error on `file`.
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }

    /// An unusable `field` of `file`.
    pub fn field(file: impl Into<PathBuf>, field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Field { file: file.into(), field: field.into(), message: message.into() }
    }

    /// An out-of-domain option.
    pub fn option(option: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Option { option: option.into(), message: message.into() }
    }
}

/// Why one line of a data file gives no document. Counted per reason in [`crate::stats::Stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum SkipReason {
    /// Not a JSON object, or a field of the wrong type.
    MalformedLine,
    /// None of `messages`, `conversations`, `text`, `input_ids`.
    UnknownFormat,
    /// A role (or ShareGPT `from`) outside the known ones.
    UnknownRole,
    /// No messages at all.
    EmptyConversation,
    /// No assistant turn, so nothing to learn.
    NoAssistantTurn,
    /// The chat template raised (or failed) while rendering.
    TemplateError,
    /// A pre-tokenized id at or above the target's vocabulary size.
    TokenOutOfVocab,
    /// Fewer than 2 consecutive supervised tokens after truncation: no anchor candidate.
    NoAnchorCandidate,
    /// An assistant turn's render does not start with the generation prompt's tokens (the
    /// template writes the earlier turns differently once the turn follows), so where the turn
    /// starts is unknown.
    PromptNotPrefix,
    /// With thinking off, an assistant's content opens `<think>` and never closes it (reasoning
    /// cut off): stripping cannot find the answer, and training on it would teach reasoning as
    /// the non-thinking output.
    UnclosedThinking,
}

impl SkipReason {
    /// Every reason, in summary order.
    pub const ALL: [SkipReason; 10] = [
        SkipReason::MalformedLine,
        SkipReason::UnknownFormat,
        SkipReason::UnknownRole,
        SkipReason::EmptyConversation,
        SkipReason::NoAssistantTurn,
        SkipReason::TemplateError,
        SkipReason::TokenOutOfVocab,
        SkipReason::NoAnchorCandidate,
        SkipReason::PromptNotPrefix,
        SkipReason::UnclosedThinking,
    ];

    /// The reason in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            SkipReason::MalformedLine => "malformed line",
            SkipReason::UnknownFormat => "no messages, conversations, text or input_ids field",
            SkipReason::UnknownRole => "unknown role",
            SkipReason::EmptyConversation => "empty conversation",
            SkipReason::NoAssistantTurn => "no assistant turn",
            SkipReason::TemplateError => "the chat template raised",
            SkipReason::TokenOutOfVocab => "token id outside the target's vocabulary",
            SkipReason::NoAnchorCandidate => "filtered: fewer than 2 consecutive supervised tokens",
            SkipReason::PromptNotPrefix => "an assistant turn's render does not start with the generation prompt",
            SkipReason::UnclosedThinking => "reasoning without its </think> while thinking is off",
        }
    }
}

/// One skipped line: the reason and a message naming the field or the template's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    pub reason: SkipReason,
    pub message: String,
}

impl Skip {
    pub fn new(reason: SkipReason, message: impl Into<String>) -> Self {
        Skip { reason, message: message.into() }
    }
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.describe(), self.message)
    }
}
