//! The models of the production path: the drafter's training step ([`drafter_step`]).

pub mod drafter_step;
