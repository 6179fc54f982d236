//! The models of the production path: the drafter's training step ([`drafter_step`]), the frozen
//! target's forward that feeds it and decodes ([`target_forward`]; the hybrid target's:
//! [`hybrid_forward`]), the drafter at inference
//! ([`drafter_decode`]) and speculative decoding with both ([`speculative`]).

pub mod drafter_decode;
pub mod drafter_step;
pub mod hybrid_forward;
pub mod speculative;
pub mod target_forward;

use dflash_reference::data::Row;

use crate::backend::Backend;
use crate::Result;

/// A frozen target's forward writing the drafter's features of packed rows: the dense
/// [`target_forward::TargetForward`] or the hybrid [`hybrid_forward::HybridForward`].
pub trait TargetFeatures {
    /// Runs the target over `rows` concatenated (at most its launch capacity), writing their
    /// features `[T, F*H]`.
    fn run(&mut self, rows: &[&Row]) -> Result<()>;
    /// The features of the last launch on the host, `[T, F*H]` as f64.
    fn features_to_host(&self) -> Result<Vec<f64>>;
    /// The device memory planned for the forward (its allocation and what lies beside it).
    fn planned_bytes(&self) -> Result<u64>;
}

impl<B: Backend> TargetFeatures for target_forward::TargetForward<B> {
    fn run(&mut self, rows: &[&Row]) -> Result<()> {
        target_forward::TargetForward::run(self, rows)
    }
    fn features_to_host(&self) -> Result<Vec<f64>> {
        target_forward::TargetForward::features_to_host(self)
    }
    fn planned_bytes(&self) -> Result<u64> {
        self.layout.total_bytes()
    }
}

impl<B: Backend> TargetFeatures for hybrid_forward::HybridForward<B> {
    fn run(&mut self, rows: &[&Row]) -> Result<()> {
        hybrid_forward::HybridForward::run(self, rows)
    }
    fn features_to_host(&self) -> Result<Vec<f64>> {
        hybrid_forward::HybridForward::features_to_host(self)
    }
    fn planned_bytes(&self) -> Result<u64> {
        self.layout.total_bytes()
    }
}
