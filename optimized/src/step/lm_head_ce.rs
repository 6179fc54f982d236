//! The frozen LM head and the decayed cross-entropy (spec section 3), forward and backward in one
//! pass over row chunks, never holding the logits of more than `chunk_rows` rows (for 8192 block
//! rows x 151936 vocab they would be ~2.5 GB in bf16).
//!
//! Only rows with a nonzero weight are visited: they are gathered `chunk_rows` at a time, their
//! logits `[chunk, V]` are overwritten in place by `dz` (one `[chunk, V]` buffer per chunk), and
//! `dz @ lm_head` is written into their rows of `dh`. The LM head is frozen: it gets no gradient.

use std::cell::Cell;

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor, WithDType};
use dflash_reference::loss::BlockTargets;
use dflash_reference::{Error, Result};

/// What one pass of the chunked LM head + CE gives: the weighted CE sum and its gradient.
pub struct LmHeadCe {
    /// `sum_r w_r CE(h_r @ lm_head^T, y_r)`, accumulated in f64.
    pub weighted_ce_sum: f64,
    /// `[R, H]`, `d(sum_r w_r CE_r)/dh`; exactly zero on rows of zero weight.
    pub dh: Tensor,
}

/// The weighted CE sum of `h @ lm_head^T` and its gradient wrt `h`; h `[R, H]`, lm_head `[V, H]`
/// (same dtype, f32 or f64, on the CPU), `targets` of `R` rows. Rows of weight 0 are never read.
/// Per chunk: `z = h_chunk @ lm_head^T`, `CE_r = logsumexp(z_r) - z_r[y_r]` and
/// `dz_r = w_r (softmax(z_r) - onehot(y_r))` in f64 from `z`, `dh_chunk = dz @ lm_head`.
pub fn lm_head_ce_forward_backward(
    h: &Tensor,
    lm_head: &Tensor,
    targets: &BlockTargets,
    chunk_rows: usize,
) -> Result<LmHeadCe> {
    validate(h, lm_head, targets, chunk_rows)?;
    match h.dtype() {
        DType::F32 => chunked::<f32>(h, lm_head, targets, chunk_rows),
        DType::F64 => chunked::<f64>(h, lm_head, targets, chunk_rows),
        other => Err(Error::invalid("h", format!("dtype {other:?}; f32 or f64 expected"))),
    }
}

/// Peak bytes of the transient buffers of one chunk, for the memory planner: the logits
/// `[chunk_rows, vocab]` in `dtype`, overwritten in place by `dz` (the `[chunk_rows, H]` gathered
/// rows and their `dh` are not counted).
pub fn lm_head_ce_chunk_bytes(chunk_rows: usize, vocab: usize, dtype: DType) -> usize {
    chunk_rows * vocab * dtype.size_in_bytes()
}

/// Checks h `[R, H >= 1]`, lm_head `[V, H]` of h's dtype on the CPU, `R` labels and weights, labels
/// below `V`, `chunk_rows >= 1`.
fn validate(h: &Tensor, lm_head: &Tensor, targets: &BlockTargets, chunk_rows: usize) -> Result<()> {
    let &[rows, hidden] = h.dims() else {
        return Err(Error::invalid("h", format!("shape {:?}; [rows, hidden] expected", h.dims())));
    };
    if hidden == 0 {
        return Err(Error::invalid("h", format!("shape {:?}; hidden >= 1 expected", h.dims())));
    }
    if !h.device().is_cpu() {
        return Err(Error::invalid("h", "not on the CPU"));
    }
    let &[vocab, lm_hidden] = lm_head.dims() else {
        return Err(Error::invalid("lm_head", format!("shape {:?}; [vocab, hidden] expected", lm_head.dims())));
    };
    if lm_hidden != hidden || lm_head.dtype() != h.dtype() || !lm_head.device().is_cpu() {
        return Err(Error::invalid(
            "lm_head",
            format!(
                "shape {:?} {:?} on {:?}; [vocab, {hidden}] {:?} on the CPU expected (h's)",
                lm_head.dims(),
                lm_head.dtype(),
                lm_head.device().location(),
                h.dtype()
            ),
        ));
    }
    if targets.labels.len() != rows || targets.weights.len() != rows {
        return Err(Error::invalid(
            "targets",
            format!("{} labels and {} weights for {rows} rows of h", targets.labels.len(), targets.weights.len()),
        ));
    }
    if let Some((r, y)) = targets.labels.iter().enumerate().find(|&(_, &y)| y as usize >= vocab) {
        return Err(Error::invalid("targets", format!("label {y} of row {r} is not below the vocab size {vocab}")));
    }
    if chunk_rows == 0 {
        return Err(Error::invalid("chunk_rows", "0; at least 1 expected"));
    }
    Ok(())
}

/// [`lm_head_ce_forward_backward`] in element type `T` on validated inputs.
fn chunked<T: WithDType>(h: &Tensor, lm_head: &Tensor, targets: &BlockTargets, chunk_rows: usize) -> Result<LmHeadCe> {
    let (rows, hidden) = h.dims2()?;
    let weighted: Vec<u32> = (0..rows as u32).filter(|&r| targets.weights[r as usize] != 0.0).collect();
    let lm_head_t = lm_head.t()?;
    let mut dh = vec![T::from_f64(0.0); rows * hidden];
    let mut weighted_ce_sum = 0.0;
    for chunk in weighted.chunks(chunk_rows) {
        let index = Tensor::from_slice(chunk, chunk.len(), h.device())?;
        let logits = h.index_select(&index, 0)?.matmul(&lm_head_t)?;
        let op = CeGradInPlace { rows: chunk, targets, weighted_ce_sum: Cell::new(0.0) };
        logits.inplace_op1(&op)?;
        weighted_ce_sum += op.weighted_ce_sum.get();
        let dh_chunk = logits.matmul(lm_head)?.flatten_all()?.to_vec1::<T>()?;
        for (&r, src) in chunk.iter().zip(dh_chunk.chunks_exact(hidden)) {
            dh[r as usize * hidden..][..hidden].copy_from_slice(src);
        }
    }
    Ok(LmHeadCe { weighted_ce_sum, dh: Tensor::from_vec(dh, (rows, hidden), h.device())? })
}

/// Overwrites the logits `[rows.len(), V]` of target rows `rows` with `dz`, leaving their
/// weighted CE sum in `weighted_ce_sum`.
struct CeGradInPlace<'a> {
    rows: &'a [u32],
    targets: &'a BlockTargets,
    weighted_ce_sum: Cell<f64>,
}

impl InplaceOp1 for CeGradInPlace<'_> {
    fn name(&self) -> &'static str {
        "lm-head-ce-grad"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, end) =
            layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("logits not contiguous".into()))?;
        let sum = match storage {
            CpuStorage::F32(z) => ce_grad_rows(&mut z[start..end], self.rows, self.targets),
            CpuStorage::F64(z) => ce_grad_rows(&mut z[start..end], self.rows, self.targets),
            _ => return Err(candle_core::Error::Msg("logits neither f32 nor f64".into())),
        };
        self.weighted_ce_sum.set(sum);
        Ok(())
    }
}

/// `z` `[rows.len(), V]` := `w_r (softmax(z_r) - onehot(y_r))`, all in f64 before rounding to `T`;
/// returns `sum_r w_r (logsumexp(z_r) - z_r[y_r])` in f64.
pub fn ce_grad_rows<T: WithDType>(z: &mut [T], rows: &[u32], targets: &BlockTargets) -> f64 {
    let vocab = z.len() / rows.len();
    let mut sum = 0.0;
    for (z, &r) in z.chunks_exact_mut(vocab).zip(rows) {
        let (y, w) = (targets.labels[r as usize] as usize, targets.weights[r as usize]);
        let max = z.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x.to_f64()));
        let lse = max + z.iter().map(|&x| (x.to_f64() - max).exp()).sum::<f64>().ln();
        let z_y = z[y].to_f64();
        sum += w * (lse - z_y);
        for x in z.iter_mut() {
            *x = T::from_f64(w * (x.to_f64() - lse).exp());
        }
        z[y] = T::from_f64(w * ((z_y - lse).exp() - 1.0));
    }
    sum
}
