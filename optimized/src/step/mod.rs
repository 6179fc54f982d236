//! The optimized drafter training step (issue 4): manual forward/backward per layer, no tape.

pub mod attention;
pub mod drafter_step;
pub mod lm_head_ce;
pub mod ops;
pub mod planned;
pub mod trainer;
