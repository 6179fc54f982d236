//! DFlash training data (spec section 6): a user's jsonl conversations and the target's
//! tokenizer to packed training rows ([`dflash_reference::data::Row`]).
//!
//! - [`source`]: jsonl files, plain or gzip, read in bounded chunks;
//! - [`format`]: the record formats (`messages`, `conversations`, `text`, `input_ids`);
//! - [`target`]: the target folder's tokenizer, special tokens and chat template;
//! - [`template`]: the chat template rendered with transformers' semantics;
//! - [`mask`]: the loss mask by prefix diffing, one row per turn when a template rewrites turns;
//! - [`rows`]: truncation, the anchor-candidate filter, packing;
//! - [`epoch`]: the held-out split and the order of each epoch;
//! - [`cache`]: the tokenized cache; [`stats`]: the counts; [`pipeline`]: all of it in one pass;
//! - [`features`]: the offline cache of the target's features per document;
//! - [`lock`]: a folder locked by the process that writes it;
//! - [`prompts`]: prompts for evaluation by speculative decoding.

pub mod cache;
pub mod epoch;
pub mod error;
pub mod features;
pub mod format;
pub mod lock;
pub mod mask;
pub mod pipeline;
pub mod prompts;
pub mod rows;
pub mod source;
pub mod stats;
pub mod target;
pub mod template;

pub use error::{Error, Result, Skip, SkipReason};
pub use pipeline::{DataOptions, Dataset, HeldOut};
