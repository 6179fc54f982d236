//! The CUDA device under everything else: the GPU (context, stream, NVRTC-compiled modules,
//! memory pool, CUDA events: [`gpu`]), device buffers ([`buffer`]), NCCL ranks ([`nccl`]),
//! per-launch profiling ([`profile`]) and page-locked staging of small uploads ([`staging`]).
//! Opened at run time; a machine without a GPU never touches it.

pub mod buffer;
pub mod gpu;
pub mod nccl;
pub mod profile;
pub mod staging;
