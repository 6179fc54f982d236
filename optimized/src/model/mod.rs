//! The models of the production path: the drafter's training step ([`drafter_step`]), the frozen
//! target's forward that feeds it and decodes ([`target_forward`]; the hybrid target's:
//! [`hybrid_forward`]), the drafter at inference
//! ([`drafter_decode`]) and speculative decoding with both ([`speculative`]).

pub mod drafter_decode;
pub mod drafter_step;
pub mod hybrid_forward;
pub mod speculative;
pub mod target_forward;
