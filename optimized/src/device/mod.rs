//! The CUDA device under everything else: the GPU (context, stream, NVRTC-compiled modules,
//! memory pool, CUDA events: [`gpu`]), device buffers ([`buffer`]), NCCL ranks ([`nccl`]) and
//! per-launch profiling ([`profile`]). Opened at run time; a machine without a GPU never touches it.

pub mod buffer;
pub mod gpu;
pub mod nccl;
pub mod profile;
