//! The planned training step (bf16 storage, fp32 arithmetic): every buffer from the memory
//! planner, one driver (`step.rs`) over a backend (`backend.rs`): the GPU (cuBLAS, the attention
//! kernels, the `step.cu` kernels of `kernels.rs`) or the CPU twin (`host.rs`); AdamW on either.

pub mod adamw;
pub mod backend;
pub mod device;
pub mod host;
pub mod kernels;
pub mod step;
