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

use crate::backend::{download, Backend};
use crate::ops::elementwise::ElementwiseOps;
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// Bytes per value of backend `B`: `(stored, arithmetic)`, as the layouts take them.
fn widths<B: Backend>() -> (u64, u64) {
    (B::Elem::BYTES as u64, <B::Elem as Elem>::Acc::BYTES as u64)
}

/// A decoding launch's next tokens: `next [R] = argmax(head (final_norm(x)))` over the last
/// `rows` of the `t` rows of the residual stream `x [t, H]`, with `(xn [R, H], inv [R],
/// logits [R, V], next)` their scratch and outputs; `dims = (t, H, V, eps)`.
fn next_tokens<B: Backend>(
    dev: &B,
    x: u64,
    (final_norm, head): (u64, u64),
    (xn, inv, logits, next): (u64, u64, u64, u64),
    (t, h, v, eps): (usize, usize, usize, f64),
    rows: usize,
) -> Result<()> {
    let first = ((t - rows) * h * B::Elem::BYTES) as u64;
    dev.ops().rms_norm_forward(x + first, final_norm, xn, inv, rows, h, eps)?;
    dev.linear(xn, rows, h, head, v, logits, 0.0)?;
    dev.ops().argmax_rows(logits, rows, v, next)
}

/// The logits `[rows][V]` at `logits` (a launch keeps `held` rows) on the host, as f64; refused
/// when one is NaN or Inf, as the reference decoder refuses them.
fn logits_to_host<B: Backend>(dev: &B, logits: u64, (rows, held): (usize, usize), v: usize) -> Result<Vec<Vec<f64>>> {
    if rows > held {
        return Err(Error::invalid("logits", format!("{rows} rows; a launch keeps {held}")));
    }
    let values = download::<B::Elem, B>(dev, logits, rows * v)?;
    if values.iter().any(|x| !x.to_f64().is_finite()) {
        return Err(Error::invalid("logits", dflash_reference::speculative::NON_FINITE_LOGITS));
    }
    Ok(values.chunks(v.max(1)).map(|row| row.iter().map(|x| x.to_f64()).collect()).collect())
}

/// A frozen target's forward writing the drafter's features of packed rows on its backend: the
/// dense [`target_forward::TargetForward`] or the hybrid [`hybrid_forward::HybridForward`]. The
/// training step copies the features into its input and reads the frozen tables in place.
pub trait TargetFeatures {
    type Backend: Backend;
    /// The backend the forward runs on.
    fn backend(&self) -> &Self::Backend;
    /// Runs the target over `rows` concatenated (at most its launch capacity), writing their
    /// features `[T, F*H]`.
    fn run(&mut self, rows: &[&Row]) -> Result<()>;
    /// The address of the last launch's features `[T, F*H]` (stored).
    fn features_addr(&self) -> u64;
    /// `(tokens of a launch at most, F*H)`.
    fn feature_shape(&self) -> (usize, usize);
    /// The address of the embedding table `[V, H]` and of the LM head `[V, H]` (the table when
    /// tied; `None` when the forward holds no LM head), stored: the drafter's frozen tables.
    fn frozen_tables(&self) -> (u64, Option<u64>);
    /// Model FLOPs of the forward of a packed row with `doc_ids` (per document, layers run).
    fn row_flops(&self, doc_ids: &[i64]) -> f64;
    /// The features of the last launch on the host, `[T, F*H]` as f64.
    fn features_to_host(&self) -> Result<Vec<f64>>;
    /// The bytes of the forward's one allocation.
    fn allocated_bytes(&self) -> u64;
    /// The device memory planned for the forward (its allocation and what lies beside it).
    fn planned_bytes(&self) -> Result<u64>;
}

impl<B: Backend> TargetFeatures for target_forward::TargetForward<B> {
    type Backend = B;
    fn backend(&self) -> &B {
        target_forward::TargetForward::backend(self)
    }
    fn run(&mut self, rows: &[&Row]) -> Result<()> {
        target_forward::TargetForward::run(self, rows)
    }
    fn features_addr(&self) -> u64 {
        target_forward::TargetForward::features_addr(self)
    }
    fn feature_shape(&self) -> (usize, usize) {
        (self.layout.dims.t, self.layout.dims.fw)
    }
    fn frozen_tables(&self) -> (u64, Option<u64>) {
        target_forward::TargetForward::frozen_tables(self)
    }
    fn row_flops(&self, doc_ids: &[i64]) -> f64 {
        target_forward::TargetForward::row_flops(self, doc_ids)
    }
    fn features_to_host(&self) -> Result<Vec<f64>> {
        target_forward::TargetForward::features_to_host(self)
    }
    fn allocated_bytes(&self) -> u64 {
        self.layout.bytes
    }
    fn planned_bytes(&self) -> Result<u64> {
        self.layout.total_bytes()
    }
}

impl<B: Backend> TargetFeatures for hybrid_forward::HybridForward<B> {
    type Backend = B;
    fn backend(&self) -> &B {
        hybrid_forward::HybridForward::backend(self)
    }
    fn run(&mut self, rows: &[&Row]) -> Result<()> {
        hybrid_forward::HybridForward::run(self, rows)
    }
    fn features_addr(&self) -> u64 {
        hybrid_forward::HybridForward::features_addr(self)
    }
    fn feature_shape(&self) -> (usize, usize) {
        (self.layout.tokens, self.layer_ids.len() * self.config.hidden_size)
    }
    fn frozen_tables(&self) -> (u64, Option<u64>) {
        hybrid_forward::HybridForward::frozen_tables(self)
    }
    fn row_flops(&self, doc_ids: &[i64]) -> f64 {
        hybrid_forward::HybridForward::row_flops(self, doc_ids)
    }
    fn features_to_host(&self) -> Result<Vec<f64>> {
        hybrid_forward::HybridForward::features_to_host(self)
    }
    fn allocated_bytes(&self) -> u64 {
        self.layout.bytes
    }
    fn planned_bytes(&self) -> Result<u64> {
        self.layout.total_bytes()
    }
}
