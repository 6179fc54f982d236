//! The production DFlash training path: manual forward/backward per layer, fused attention
//! kernels (CUDA through cudarc and NVRTC, each with a CPU twin), activation checkpointing, the
//! memory planner, mixed precision and the trainer (DESIGN.md, "optimized/").
//!
//! Each piece is proven equal to `dflash-reference` by the conformance suite before it is used:
//! the fused attention ([`attention`]: plan, CPU twin, CUDA kernels), the training step with its
//! manual backward ([`step`], CPU for now), and the memory planner ([`planner`]).

pub mod attention;
pub mod blas;
pub mod gpu;
pub mod kernels;
pub mod planner;
pub mod profile;
pub mod step;
