//! The training step on the GPU (bf16 compute, fp32 gradients): device buffers, the `step.cu`
//! kernels, the step itself, AdamW on the device, and the checks `xtask gpu-conformance` runs.

pub mod adamw;
pub mod backend;
pub mod device;
pub mod host;
pub mod kernels;
pub mod step;
