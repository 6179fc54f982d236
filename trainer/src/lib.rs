//! The machinery of a DFlash training run, around a step engine: the run's config and its
//! validation ([`config`]), the loop with its data order, schedule and non-finite handling
//! ([`run`]), the step engines ([`engine`]: the CPU ones and the device one), data-parallel
//! workers ([`dist`]), a run's rows ([`rows`]), a real run's checked setup ([`real`]), atomic
//! checkpoints and exact resumption ([`checkpoint`]), metrics, evaluation and the plot
//! ([`metrics`]), the built-in tiny setup ([`builtin`]) and `--plan`'s estimate ([`plan`]).

pub mod builtin;
pub mod checkpoint;
pub mod config;
pub mod dist;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod plan;
pub mod real;
pub mod rows;
pub mod run;

pub use error::{Error, Result};
