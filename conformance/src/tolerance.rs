//! Named tolerances (each with its reason) and the relative error they bound.

use candle_core::{DType, Tensor};

/// A bound on `||got - want|| / ||want||`, with why it is that value.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub rel: f64,
    pub reason: &'static str,
}

/// Reference gradients vs central finite differences, both in f64.
pub const FD_F64: Tolerance = Tolerance {
    rel: 1e-6,
    reason: "central differences in f64: truncation O(eps^2) ~1e-10 plus rounding ~1e-16/eps ~1e-10, far below 1e-6",
};

/// The Rust reference in f32 vs an independent f32/f64 oracle (PyTorch, transformers).
pub const ORACLE_F32: Tolerance = Tolerance {
    rel: 1e-4,
    reason: "f32 rounding (~6e-8 per op) accumulated over a few hundred ops of tiny models, different op order",
};

/// The Rust reference in f64 vs an f64 oracle computed from the same f32-exact inputs.
pub const ORACLE_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "f64 rounding (~1e-16 per op) with different op order; RoPE tables computed alike in f64",
};

/// `||got - want|| / ||want||` in f64 (`||got||` when `want` is zero); infinity if either
/// holds NaN or Inf, so that NaN never passes.
pub fn rel_error(got: &Tensor, want: &Tensor) -> f64 {
    let flat = |t: &Tensor| t.to_dtype(DType::F64).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f64>());
    let (g, w) = (flat(got).expect("got to f64"), flat(want).expect("want to f64"));
    assert_eq!(g.len(), w.len(), "element counts differ: {:?} vs {:?}", got.dims(), want.dims());
    if g.iter().chain(&w).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let diff: f64 = g.iter().zip(&w).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
    let norm: f64 = w.iter().map(|b| b * b).sum::<f64>().sqrt();
    let gnorm: f64 = g.iter().map(|a| a * a).sum::<f64>().sqrt();
    if norm == 0.0 {
        gnorm
    } else {
        diff / norm
    }
}

/// Panics naming `what`, the error and the tolerance's reason when `got` is not within `tol`.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: Tolerance) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let err = rel_error(got, want);
    assert!(err <= tol.rel, "{what}: relative error {err:.3e} above {:.0e} ({})", tol.rel, tol.reason);
}

/// A clipped global grad norm vs `max_norm`. Clipping follows PyTorch's `clip_grad_norm_`:
/// the scale `max_norm / (norm + 1e-6)` leaves the clipped norm `1e-6 / (norm + 1e-6)`
/// relative below `max_norm`, under 1e-6 when `norm > max_norm >= 1` (f64 rounding ~1e-16).
pub const CLIP_NORM: Tolerance = Tolerance {
    rel: 1e-6,
    reason: "PyTorch-style clipping divides by norm + 1e-6: the clipped norm is 1e-6/norm relative below max_norm (max_norm >= 1)",
};

/// The CPU twin of the fused attention in f64 vs the reference dense attention in f64.
pub const TWIN_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "the same math in f64 in another order (tile-wise online softmax vs dense softmax and matmul): \
             ~1e-16 per op over sums of a few hundred keys",
};

/// The CPU twin's output and log-sum-exp in f32 vs the reference in f64 on the same f32-exact inputs.
pub const TWIN_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "the twin's own f32 rounding (~6e-8 per op) over dot products of d <= 16 and sums of positive \
             weights over a few hundred keys with online rescaling; the f64 reference adds nothing",
};

/// The f32 twin's attention gradients vs the f64 reference, divided by the norm of the sum of
/// their terms' absolute values (`scale * p * (|dout|.|v| + |dout|.|out|) * |k|` and the like:
/// every product summed, inside the dot products too), not by their own.
pub const TWIN_F32_GRAD_TERMS: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "the backward sums signed terms (ds = p (dp - Dsum), p * dout) that can cancel to 1e-4 of their \
             size (peaked softmax, few keys); f32 rounding (~6e-8) scales with the terms, not with what is left",
};

/// The optimized step's chunked LM head + CE in f64 vs the reference's full logits and autograd in f64.
pub const LM_HEAD_CE_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "the same math in f64 in another order (per-row log-sum-exp and softmax, chunked matmuls): \
             ~1e-16 per op over sums of V <= 50 and H <= 24 terms",
};

/// The chunked LM head + CE in f32 vs the reference in f64 on the same f32-exact inputs.
pub const LM_HEAD_CE_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "f32 rounding (~6e-8 per op) of the logits and dh matmuls over H <= 24 and V <= 50 terms; the CE \
             and softmax run in f64 from the f32 logits, and a CE's error is its gradient times the logit \
             errors, so peaked rows (small CE) keep their relative precision",
};

/// A manual backward of the optimized step (`step::ops`) vs candle autograd through the reference
/// op, both in f64; forwards vs the reference forward. Gradients whose terms can cancel (RMSNorm,
/// silu') are divided by the norm of their terms' absolute values, not by their own.
pub const STEP_OP_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "the same few terms per element (sums over <= 80 rows or <= 24 columns) in another order or \
             factored differently, ~1e-16 per op; measured <= 2e-15 over 20000 random cases per op",
};

/// The same as `STEP_OP_F64` with both sides in f32 on the same inputs.
pub const STEP_OP_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "f32 rounding (~6e-8 per op) of the same few terms per element in another order or factored \
             differently; measured <= 1e-6 over 20000 random cases per op",
};

/// The drafter step on the CPU twins storing f64 against the reference in f64: the same
/// operations in another order (chunked LM head, tiled online softmax), so f64 rounding only.
pub const STEP_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "f64 twins and the f64 reference differ only in summation order and the online softmax (~1e-14)",
};

/// The drafter step on the CPU twins storing f32 against the reference in f64.
pub const STEP_F32: Tolerance = Tolerance {
    rel: 1e-4,
    reason: "two f32 computations of ~100 ops in different orders (fused attention with online softmax vs dense, chunked CE vs full), rounding ~6e-8 per op amplified by the attention backward's cancellation in p*(dp - D)",
};

/// Each parameter's gradient of the step on the f32 twins against the reference in f64, on
/// random tiny cases (the loss stays within [`STEP_F32`]). A row that sees a single key adds a
/// score-path term that is zero in exact arithmetic (`p (dp - D)` with `p = 1`, `D = dp`) but
/// leaves f32 rounding; where the true score-path gradient (q/k projections and norms) is small,
/// that noise is large relative to it. Measured over 6400 random cases: the worst tensor of a
/// case has a median error of 8.6e-7, the worst of all 2.4e-4; 1e-3 leaves 4x above it, while a
/// wrong gradient is off by O(1).
pub const STEP_F32_GRADS: Tolerance = Tolerance {
    rel: 1e-3,
    reason: "f32 rounding of score-path terms that are zero in exact arithmetic (rows seeing one key), relative to a small q/k gradient: worst of 6400 random cases 2.4e-4",
};

/// The GPU step (bf16 activations and weights, fp32 accumulation and gradients) against the
/// reference in f64 on the same weights (issue 4's bound).
pub const GPU_STEP_BF16: Tolerance = Tolerance {
    rel: 2e-2,
    reason: "bf16 storage of activations, logits and gradients rounds each to 2^-9 (~2e-3) relative; the \
             roundings compound over the layers and are amplified where the attention backward's p*(dp - D) \
             cancels; measured up to 1.4e-2 on the q/k norm weights (sums over every row and head)",
};

/// A bf16 output of an elementwise kernel (or the bf16 twin) against the f64 twin on the same
/// (bf16-exact) inputs.
pub const GPU_KERNEL_BF16: Tolerance = Tolerance {
    rel: 1e-2,
    reason: "the kernel rounds its fp32 result to bf16 once (2^-9 ~ 2e-3 relative) after fp32 arithmetic \
             (~6e-8 per op)",
};

/// An fp32 output of an elementwise kernel (inverse RMS, per-row CE, AdamW's update, sums of
/// squares, accumulation) against the f64 twin on the same inputs.
pub const KERNEL_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "fp32 arithmetic (~6e-8 per op) over sums of at most 1e5 terms and a log-sum-exp over at most \
             160k logits, no rounding to bf16",
};

/// Two computations of the same f32 values each rounded to bf16 (the Rust and the transformers
/// feature-cache writers, both in f32): they differ only where the f32 results straddle a
/// rounding boundary, by one bf16 ulp there.
pub const BF16_STORAGE: Tolerance = Tolerance {
    rel: 4e-3,
    reason: "one bf16 ulp (2^-8 relative) on the elements whose f32 values (equal to ~1e-6) round to \
             neighbouring bf16 values",
};

/// Copies (row gather and scatter): the same bits.
pub const EXACT: Tolerance = Tolerance { rel: 0.0, reason: "a copy moves values without arithmetic" };

/// The device AdamW (accumulate, clip, update) on a step's gradients against the reference
/// optimizer on the same gradients, both from the same fp32 master weights, compared by the
/// update `p_after - p_before`.
pub const ADAMW_F32: Tolerance = Tolerance {
    rel: 1e-4,
    reason: "both sides hold the parameters in fp32: an update of lr = 2e-3 on parameters near 1 is known \
             to one ulp of the parameter, 6e-8 / 2e-3 = 3e-5 of itself; the clipping norm in fp32 partials \
             vs f64 adds ~1e-7",
};

/// The GPU's chunked delta rule (`gated_delta`: tensor-core products of bf16 operands) against the
/// f64 twin on the same inputs: its output and the carried state.
pub const GDN_DELTA_BF16: Tolerance = Tolerance {
    rel: 2e-2,
    reason: "the chunk's products take bf16 operands (W, the state, Delta, the scaled UT inverse and P, \
             each rounded once to 2^-9 ~ 2e-3 relative) into fp32 accumulators; Delta = U - W S can cancel, \
             and the state carries its rounding over the chunks of a document; the output is rounded to \
             bf16 once more",
};

/// The hybrid target's bf16 forward (the GPU, or the bf16 CPU twins) against the reference in f32
/// on `hybrid_cases::random_hybrid_cases` (4 layers, 3 of them GatedDeltaNet).
pub const HYBRID_BF16: Tolerance = Tolerance {
    rel: 3e-2,
    reason: "bf16 storage of the residual stream and of every activation, as transformers stores them: a \
             GatedDeltaNet layer rounds about ten of them (projections, conv, the delta rule's output, the gated \
             norm, the MLP) and the features' error grows by ~7e-3 per such layer; the bf16 CPU twins (the same \
             storage, f32 arithmetic) measure 1.8-1.9e-2 on these cases, the H200 1.98e-2 (its tensor-core \
             operands add < 1e-3); transformers' own bf16 forward of the same cases measures 1.9-2.1e-2 \
             (`xtask bench hybrid`, results/target-hybrid-16-layers-h200.json), so no bf16 pipeline like it \
             meets 1e-2; rounding only part of the tensor cores' inputs (the normed inputs, the gated norm's output, \
             the delta rule's q and k) already costs 1.16e-2 on these cases (README, the hybrid target)",
};
