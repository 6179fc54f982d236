//! The models of the production path: the drafter's training step ([`drafter_step`]) and the
//! frozen target's forward that feeds it ([`target_forward`]).

pub mod drafter_step;
pub mod target_forward;
