//! The production DFlash training path (DESIGN.md, "optimized/"): each concept has one home.
//!
//! - [`ops`]: every operation with its API, its CPU twin, its CUDA launcher and its kernel
//!   source side by side: the fused block-sparse attention, the elementwise and reduction ops,
//!   the matmul; the constants Rust and CUDA share; the kernels' hash.
//! - [`device`]: the CUDA device under everything (NVRTC, memory pool, CUDA events, buffers).
//! - [`backend`]: where ops run on raw addresses: [`backend::host::Host`] (the CPU twins, storing
//!   bf16, f32 or f64) and [`backend::cuda::Cuda`] (cuBLAS and the kernels, bf16).
//! - [`memory`]: every byte formula, in checked arithmetic; the typed layout of a step.
//! - [`model`]: the drafter's training step, one driver over any backend.
//! - [`flops`]: the model FLOPs of the step and the target's forward, and the peak of MFU.
//! - [`train`]: what a training loop takes from the step: the AdamW on the step's backend and
//!   the step's gradients for the reference loop.
//!
//! Each piece is proven equal to `dflash-reference` by the conformance suite before it is used.

pub mod backend;
pub mod device;
pub mod error;
pub mod flops;
pub mod memory;
pub mod model;
pub mod ops;
pub mod train;

pub use error::{Error, Result};
