//! The DFlash specification in code (the project's spec, dflash.md): candle-core on the CPU, f32 or f64,
//! autograd, dense attention with an explicit boolean mask. No cleverness: each module reads
//! next to its section of the spec.
//!
//! - [`config`]: drafter and target `config.json` (spec 1); [`mask`]: the training mask (spec 2);
//! - [`anchors`], [`loss`], [`optim`], [`train`]: training (spec 3); [`data`]: the training row
//!   (spec 6: tokens, loss mask, packed documents, positions) and a row with its features;
//! - [`drafter`], [`target`], [`attention`], [`ops`]: the models (spec 1);
//! - [`hybrid`]: the Qwen3.5 / Qwen3.6 hybrid target, GatedDeltaNet and gated attention (spec 10);
//! - [`speculative`]: greedy speculative decoding and tau (spec 4);
//! - [`builtin`]: the tiny built-in target, drafter and data of `cargo xtask train`.

pub mod anchors;
pub mod attention;
pub mod builtin;
pub mod config;
pub mod data;
pub mod drafter;
pub mod error;
pub mod eval;
pub mod hash;
pub mod hybrid;
pub mod io;
pub mod json_fields;
pub mod loss;
pub mod mask;
pub mod ops;
pub mod optim;
pub mod speculative;
pub mod target;
pub mod train;

pub use error::{Error, Result};
