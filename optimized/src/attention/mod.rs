//! Fused attention: the plan (O(groups) metadata), the CPU twin of the kernels, and the CUDA
//! kernels. Never a dense mask, a score matrix or K/V expanded to the query heads.

pub mod cases;
pub mod cpu;
pub mod cuda;
pub mod plan;
