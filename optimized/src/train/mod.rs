//! What a training loop takes from the production step: AdamW on the step's backend
//! ([`adamw`]) and the step's batch gradients for the reference's loop ([`gradients`]).

pub mod adamw;
pub mod gradients;
