//! The production DFlash training path: manual forward/backward per layer, fused attention
//! kernels (CUDA through cudarc and NVRTC, each with a CPU twin), activation checkpointing, the
//! memory planner, mixed precision and the trainer (DESIGN.md, "optimized/").
//!
//! Filled issue by issue: the fused attention first; the optimized training step arrives with its own
//! issues, each proven equal to `dflash-reference` by the conformance suite before it is used.

pub mod attention;
pub mod gpu;
pub mod kernels;
pub mod planner;
pub mod step;
