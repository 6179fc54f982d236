//! The GatedDeltaNet layer of the hybrid target (spec section 10), in two forms that compute the
//! same thing: the **recurrent** form (the spec, token by token) and the **chunked** form (the
//! WY / UT representation inside a chunk of `C` tokens, the state carried from chunk to chunk:
//! what a prefill kernel runs).
//!
//! Packed rows: a `starts` flag per token marks where a document begins; there the conv window
//! and the recurrent state restart from zero, so each document sees nothing of the one before.

use candle_core::{DType, Device, Tensor, D};

use super::config::GdnDims;
use super::layers::{sigmoid, softplus};
use crate::error::{Error, Result};
use crate::ops::{linear, rms_norm, silu};

/// `eps` of the L2 norms of q and k: `x / sqrt(sum(x^2) + eps)` (transformers' and FLA's).
pub const L2_NORM_EPS: f64 = 1e-6;

/// The chunk length of transformers' and FLA's prefill.
pub const DEFAULT_CHUNK: usize = 64;

/// Which form computes the delta rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// Token by token (the spec).
    Recurrent,
    /// In chunks of `chunk` tokens (WY / UT form); chunks start again at each document start.
    Chunked { chunk: usize },
}

/// The inputs of the delta rule for `T` tokens and `H` (= `H_v`) heads, q and k already repeated
/// to `H` heads, L2-normed, and q scaled by `d_k^-0.5`.
pub struct DeltaInputs {
    /// `[T, H, d_k]`.
    pub q: Tensor,
    /// `[T, H, d_k]`.
    pub k: Tensor,
    /// `[T, H, d_v]`.
    pub v: Tensor,
    /// `[T, H]`: the log decay `g_t <= 0` (`alpha_t = exp(g_t)`).
    pub g: Tensor,
    /// `[T, H]`: the write strength `beta_t` in (0, 1).
    pub beta: Tensor,
}

/// The GatedDeltaNet weights of one layer (HF names under `linear_attn.`).
pub struct GdnWeights<'a> {
    /// `in_proj_qkv.weight` `[2*H_k*d_k + H_v*d_v, hidden]`: q, k, v, in that order.
    pub in_proj_qkv: &'a Tensor,
    /// `in_proj_z.weight` `[H_v*d_v, hidden]`: the output gate.
    pub in_proj_z: &'a Tensor,
    /// `in_proj_b.weight` `[H_v, hidden]`: `beta = sigmoid(b)`.
    pub in_proj_b: &'a Tensor,
    /// `in_proj_a.weight` `[H_v, hidden]`: `g = -exp(A_log) * softplus(a + dt_bias)`.
    pub in_proj_a: &'a Tensor,
    /// `conv1d.weight` `[conv_dim, 1, K]`: depthwise, no bias; tap `K-1` multiplies the current token.
    pub conv1d: &'a Tensor,
    /// `A_log` `[H_v]`.
    pub a_log: &'a Tensor,
    /// `dt_bias` `[H_v]`.
    pub dt_bias: &'a Tensor,
    /// `norm.weight` `[d_v]`: the output RMSNorm's weight (plain `* w`, not zero-centred).
    pub norm: &'a Tensor,
    /// `out_proj.weight` `[hidden, H_v*d_v]`.
    pub out_proj: &'a Tensor,
}

/// One flag per token: true where a document starts (the first token, and wherever the
/// document id changes).
pub fn segment_starts(doc_ids: &[i64]) -> Vec<bool> {
    (0..doc_ids.len()).map(|t| t == 0 || doc_ids[t] != doc_ids[t - 1]).collect()
}

/// The token ranges between starts.
fn segments(starts: &[bool]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (t, &start) in starts.iter().enumerate() {
        match out.last_mut() {
            Some(run) if !start => run.end = t + 1,
            _ => out.push(t..t + 1),
        }
    }
    out
}

fn check_starts(starts: &[bool], tokens: usize) -> Result<()> {
    if starts.len() != tokens {
        return Err(Error::invalid("starts", format!("{} flags for {tokens} tokens", starts.len())));
    }
    if tokens == 0 {
        return Err(Error::invalid("tokens", "no tokens"));
    }
    Ok(())
}

/// Depthwise causal conv1d over time, no bias, zero left padding that restarts at each document
/// start: `out[t, c] = sum_{s=0}^{K-1} w[c, K-1-s] * x[t-s, c]`, where `x[t-s]` counts as zero
/// when it lies before the start of `t`'s document. x `[T, C]`, w `[C, K]` -> `[T, C]`.
pub fn causal_conv1d(x: &Tensor, w: &Tensor, starts: &[bool]) -> Result<Tensor> {
    let (t_len, channels) = x.dims2()?;
    let (w_channels, kernel) = w.dims2()?;
    if w_channels != channels {
        return Err(Error::invalid("conv1d.weight", format!("{w_channels} channels for an input of {channels}")));
    }
    check_starts(starts, t_len)?;
    let mut doc_start = vec![0; t_len];
    for t in 0..t_len {
        doc_start[t] = if starts[t] || t == 0 { t } else { doc_start[t - 1] };
    }
    let mut out = Tensor::zeros((t_len, channels), x.dtype(), &Device::Cpu)?;
    for lag in 0..kernel {
        // Row t reads token t - lag when that is inside t's document, else zero.
        let valid: Vec<bool> = (0..t_len).map(|t| t >= lag && t - lag >= doc_start[t]).collect();
        let index: Vec<u32> = (0..t_len).map(|t| if valid[t] { (t - lag) as u32 } else { 0 }).collect();
        let keep: Vec<f64> = valid.iter().map(|&v| f64::from(u8::from(v))).collect();
        let index = Tensor::from_vec(index, t_len, &Device::Cpu)?;
        let keep = Tensor::from_vec(keep, (t_len, 1), &Device::Cpu)?.to_dtype(x.dtype())?;
        let shifted = x.index_select(&index, 0)?.broadcast_mul(&keep)?;
        let tap = w.narrow(1, kernel - 1 - lag, 1)?.squeeze(1)?; // [C]
        out = (out + shifted.broadcast_mul(&tap)?)?;
    }
    Ok(out)
}

/// `x / sqrt(sum(x^2) + eps)` over the last dim.
pub fn l2_normalize(x: &Tensor, eps: f64) -> Result<Tensor> {
    let inv = x.sqr()?.sum_keepdim(D::Minus1)?.affine(1.0, eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?)
}

/// `[T, H_k, d]` -> `[T, H_k * group, d]`: value head `h` reads key head `h / group`
/// (transformers' `repeat_interleave`).
pub fn repeat_heads(x: &Tensor, group: usize) -> Result<Tensor> {
    let (t, heads, d) = x.dims3()?;
    Ok(x.unsqueeze(2)?.broadcast_as((t, heads, group, d))?.reshape((t, heads * group, d))?)
}

/// The delta rule token by token, per head (spec section 10): with `S` `[d_k, d_v]` zero at each
/// document start, `S = alpha_t S; m = S^T k_t; delta = beta_t (v_t - m); S += k_t delta^T;
/// o_t = S^T q_t`, as plain loops in f64 (the result in the inputs' dtype). Returns o
/// `[T, H, d_v]`.
pub fn gated_delta_recurrent(inp: &DeltaInputs, starts: &[bool]) -> Result<Tensor> {
    let (t_len, heads, dk) = inp.k.dims3()?;
    let dv = inp.v.dim(2)?;
    check_starts(starts, t_len)?;
    let flat = |x: &Tensor| -> Result<Vec<f64>> { Ok(x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?) };
    let (q, k, v) = (flat(&inp.q)?, flat(&inp.k)?, flat(&inp.v)?);
    let (g, beta) = (flat(&inp.g)?, flat(&inp.beta)?); // [T, H]
    let mut state = vec![0.0; heads * dk * dv]; // [H, d_k, d_v]
    let mut out = vec![0.0; t_len * heads * dv];
    for (t, &start) in starts.iter().enumerate() {
        if start {
            state.fill(0.0);
        }
        for h in 0..heads {
            let th = t * heads + h;
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            let (q_t, k_t, v_t) = (&q[th * dk..][..dk], &k[th * dk..][..dk], &v[th * dv..][..dv]);
            let alpha = g[th].exp();
            s.iter_mut().for_each(|x| *x *= alpha);
            let delta: Vec<f64> =
                (0..dv).map(|j| beta[th] * (v_t[j] - (0..dk).map(|i| s[i * dv + j] * k_t[i]).sum::<f64>())).collect();
            for (i, &k_i) in k_t.iter().enumerate() {
                s[i * dv..(i + 1) * dv].iter_mut().zip(&delta).for_each(|(x, d)| *x += k_i * d);
            }
            for (j, o) in out[th * dv..][..dv].iter_mut().enumerate() {
                *o = (0..dk).map(|i| s[i * dv + j] * q_t[i]).sum();
            }
        }
    }
    Ok(Tensor::from_vec(out, (t_len, heads, dv), &Device::Cpu)?.to_dtype(inp.v.dtype())?)
}

/// The same delta rule in chunks of `chunk` tokens (each document chunked from its own start),
/// per head. Inside a chunk of `n` tokens entered with state `S_0`, with `gamma_i = g_1 + .. + g_i`
/// (the chunk's cumulative log decay) and `D_ij = exp(gamma_i - gamma_j)` for `j <= i` (else 0):
/// - the writes `delta_i` (rows of `Delta`, `[n, d_v]`) solve
///   `(I + A) Delta = beta V - (beta exp(gamma) K) S_0` with `A_ij = beta_i D_ij (k_i . k_j)` for
///   `j < i` (strictly lower): the UT transform `T = (I + A)^-1` gives `U = T (beta V)` and
///   `W = T (beta exp(gamma) K)`, so `Delta = U - W S_0`;
/// - the outputs are `O = (exp(gamma) Q) S_0 + (Q K^T * D) Delta`;
/// - the state leaving is `S_n = exp(gamma_n) S_0 + (exp(gamma_n - gamma) K)^T Delta`.
///
/// Returns o `[T, H, d_v]`.
pub fn gated_delta_chunked(inp: &DeltaInputs, starts: &[bool], chunk: usize) -> Result<Tensor> {
    if chunk == 0 {
        return Err(Error::invalid("chunk", "must be at least 1"));
    }
    let (t_len, heads, dk) = inp.k.dims3()?;
    let dv = inp.v.dim(2)?;
    check_starts(starts, t_len)?;
    let g = inp.g.to_dtype(DType::F64)?.to_vec2::<f64>()?; // [T][H]
    let mut pieces = Vec::new(); // [n, H, d_v] per chunk, in token order
    for doc in segments(starts) {
        let mut states = vec![Tensor::zeros((dk, dv), inp.v.dtype(), &Device::Cpu)?; heads];
        for begin in doc.clone().step_by(chunk) {
            let n = chunk.min(doc.end - begin);
            let mut per_head = Vec::with_capacity(heads);
            for (h, state) in states.iter_mut().enumerate() {
                let take = |x: &Tensor| -> Result<Tensor> { Ok(x.narrow(0, begin, n)?.narrow(1, h, 1)?.squeeze(1)?) };
                let log_decay: Vec<f64> = (begin..begin + n).map(|t| g[t][h]).collect();
                let (o, next) =
                    chunk_step(&take(&inp.q)?, &take(&inp.k)?, &take(&inp.v)?, &log_decay, &take(&inp.beta)?, state)?;
                *state = next;
                per_head.push(o);
            }
            pieces.push(Tensor::stack(&per_head, 1)?);
        }
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

/// One chunk of one head (see [`gated_delta_chunked`]): q, k `[n, d_k]`, v `[n, d_v]`, `g` the
/// `n` log decays, beta `[n]`, state `[d_k, d_v]` -> (o `[n, d_v]`, the state after the chunk).
fn chunk_step(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &[f64],
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (n, dtype) = (g.len(), q.dtype());
    let mut gamma = Vec::with_capacity(n);
    for &log_decay in g {
        gamma.push(gamma.last().copied().unwrap_or(0.0) + log_decay);
    }
    let matrix = |f: &dyn Fn(usize, usize) -> f64| -> Result<Tensor> {
        let values: Vec<f64> = (0..n * n).map(|e| f(e / n, e % n)).collect();
        Ok(Tensor::from_vec(values, (n, n), &Device::Cpu)?.to_dtype(dtype)?)
    };
    let column = |f: &dyn Fn(usize) -> f64| -> Result<Tensor> {
        Ok(Tensor::from_vec((0..n).map(f).collect::<Vec<f64>>(), (n, 1), &Device::Cpu)?.to_dtype(dtype)?)
    };
    let decay = matrix(&|i, j| if j <= i { (gamma[i] - gamma[j]).exp() } else { 0.0 })?;
    let strictly_lower = matrix(&|i, j| f64::from(u8::from(j < i)))?;
    let exp_gamma = column(&|i| gamma[i].exp())?;
    let to_end = column(&|i| (gamma[n - 1] - gamma[i]).exp())?;
    let beta = beta.reshape((n, 1))?;
    let k_t = k.t()?.contiguous()?;

    let a = k.matmul(&k_t)?.mul(&decay)?.broadcast_mul(&beta)?.mul(&strictly_lower)?;
    let ut = unit_lower_inverse(&a)?;
    let u = ut.matmul(&v.broadcast_mul(&beta)?)?; // [n, d_v]
    let w = ut.matmul(&k.broadcast_mul(&beta)?.broadcast_mul(&exp_gamma)?)?; // [n, d_k]
    let delta = (u - w.matmul(state)?)?; // [n, d_v]
    let o = (q.broadcast_mul(&exp_gamma)?.matmul(state)? + q.matmul(&k_t)?.mul(&decay)?.matmul(&delta)?)?;
    let next = (state.affine(gamma[n - 1].exp(), 0.0)? + k.broadcast_mul(&to_end)?.t()?.matmul(&delta)?)?;
    Ok((o, next))
}

/// `(I + A)^-1` for a strictly lower-triangular `A` `[n, n]`, by forward substitution: row `i` of
/// the inverse is `e_i - sum_{j<i} A_ij row_j`.
fn unit_lower_inverse(a: &Tensor) -> Result<Tensor> {
    let n = a.dim(0)?;
    let eye = Tensor::eye(n, a.dtype(), &Device::Cpu)?;
    let mut rows: Vec<Tensor> = Vec::with_capacity(n);
    for i in 0..n {
        let mut row = eye.get(i)?;
        if i > 0 {
            let above = Tensor::stack(&rows, 0)?; // [i, n]
            let coefficients = a.get(i)?.narrow(0, 0, i)?.unsqueeze(0)?; // [1, i]
            row = (row - coefficients.matmul(&above)?.squeeze(0)?)?;
        }
        rows.push(row);
    }
    Ok(Tensor::stack(&rows, 0)?)
}

/// The GatedDeltaNet token mixer (spec section 10) on the normed input x `[T, hidden]`:
/// q, k, v from `in_proj_qkv`, the causal conv and SiLU over their channels, q and k repeated to
/// `H_v` heads and L2-normed (q also scaled by `d_k^-0.5`), `beta = sigmoid(b)`,
/// `g = -exp(A_log) * softplus(a + dt_bias)`, the delta rule in `form`, then per head
/// `RMSNorm(o) * w * SiLU(z)`, concatenated, `out_proj`. Returns `[T, hidden]`.
pub fn gdn_layer(
    x: &Tensor,
    w: &GdnWeights,
    dims: &GdnDims,
    eps: f64,
    starts: &[bool],
    form: GdnForm,
) -> Result<Tensor> {
    let t = x.dim(0)?;
    let (key_dim, hv, dk, dv) = (dims.key_dim(), dims.num_value_heads, dims.key_head_dim, dims.value_head_dim);
    let conv = w.conv1d.reshape((dims.conv_dim(), dims.conv_kernel))?;
    let mixed = silu(&causal_conv1d(&linear(x, w.in_proj_qkv)?, &conv, starts)?)?; // [T, conv_dim]
    let heads = |start: usize, width: usize, d: usize| -> Result<Tensor> {
        Ok(mixed.narrow(1, start, width)?.reshape((t, width / d, d))?)
    };
    let q = repeat_heads(&heads(0, key_dim, dk)?, dims.group_size())?;
    let k = repeat_heads(&heads(key_dim, key_dim, dk)?, dims.group_size())?;
    let inputs = DeltaInputs {
        q: l2_normalize(&q, L2_NORM_EPS)?.affine((dk as f64).powf(-0.5), 0.0)?,
        k: l2_normalize(&k, L2_NORM_EPS)?,
        v: heads(2 * key_dim, dims.value_dim(), dv)?,
        g: softplus(&linear(x, w.in_proj_a)?.broadcast_add(w.dt_bias)?)?.broadcast_mul(&w.a_log.exp()?.neg()?)?,
        beta: sigmoid(&linear(x, w.in_proj_b)?)?,
    };
    let o = match form {
        GdnForm::Recurrent => gated_delta_recurrent(&inputs, starts)?,
        GdnForm::Chunked { chunk } => gated_delta_chunked(&inputs, starts, chunk)?,
    }; // [T, H_v, d_v]
    let z = linear(x, w.in_proj_z)?.reshape((t, hv, dv))?;
    let gated = (rms_norm(&o, w.norm, eps)? * silu(&z)?)?;
    linear(&gated.reshape((t, hv * dv))?, w.out_proj)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Chunked against recurrent in f64: the two only reorder sums of products of the same
    /// numbers (and invert a unit triangular matrix), so they agree to rounding.
    const CHUNKED_VS_RECURRENT_F64: f64 = 1e-10;

    fn tensor(values: Vec<f64>, shape: &[usize]) -> Tensor {
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
        let diff = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
        let norm = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
        diff / norm
    }

    /// Random delta-rule inputs as the layer makes them: unit k, q of norm `d_k^-0.5`, v normal,
    /// `g = -exp(A) softplus(a)` and `beta = sigmoid(b)` from normal A, a, b.
    fn random_inputs(t: usize, heads: usize, dk: usize, dv: usize, rng: &mut ChaCha8Rng) -> DeltaInputs {
        let mut normal =
            |n: usize| -> Vec<f64> { (0..n).map(|_| rng.sample::<f64, _>(rand_distr::StandardNormal)).collect() };
        let q = l2_normalize(&tensor(normal(t * heads * dk), &[t, heads, dk]), L2_NORM_EPS).unwrap();
        let k = l2_normalize(&tensor(normal(t * heads * dk), &[t, heads, dk]), L2_NORM_EPS).unwrap();
        let a_log = tensor(normal(heads), &[heads]).affine(0.5, 0.0).unwrap();
        let a = tensor(normal(t * heads), &[t, heads]);
        DeltaInputs {
            q: q.affine((dk as f64).powf(-0.5), 0.0).unwrap(),
            k,
            v: tensor(normal(t * heads * dv), &[t, heads, dv]),
            g: softplus(&a).unwrap().broadcast_mul(&a_log.exp().unwrap().neg().unwrap()).unwrap(),
            beta: sigmoid(&tensor(normal(t * heads), &[t, heads])).unwrap(),
        }
    }

    /// The recurrent form on a case small enough to follow by hand: one head, d_k = d_v = 2,
    /// two tokens, alpha = beta = 1/2 for both.
    /// Token 1: k = (1, 0), v = (2, 4), q = (1, 0). S = 0 decays to 0, m = 0,
    ///   delta = 0.5 (2, 4) = (1, 2), S = k delta^T = [[1, 2], [0, 0]], o = S^T q = (1, 2).
    /// Token 2: k = (0.6, 0.8), v = (1, -1), q = (0, 1). S decays to [[0.5, 1], [0, 0]];
    ///   m = S^T k = (0.3, 0.6); delta = 0.5 ((1, -1) - (0.3, 0.6)) = (0.35, -0.8);
    ///   S += k delta^T = [[0.5 + 0.21, 1 - 0.48], [0.28, -0.64]] = [[0.71, 0.52], [0.28, -0.64]];
    ///   o = S^T q = (0.28, -0.64).
    #[test]
    fn recurrent_by_hand() {
        let half = 0.5f64.ln();
        let inputs = DeltaInputs {
            q: tensor(vec![1.0, 0.0, 0.0, 1.0], &[2, 1, 2]),
            k: tensor(vec![1.0, 0.0, 0.6, 0.8], &[2, 1, 2]),
            v: tensor(vec![2.0, 4.0, 1.0, -1.0], &[2, 1, 2]),
            g: tensor(vec![half, half], &[2, 1]),
            beta: tensor(vec![0.5, 0.5], &[2, 1]),
        };
        let want = tensor(vec![1.0, 2.0, 0.28, -0.64], &[2, 1, 2]);
        let starts = [true, false];
        for (form, got) in [
            ("recurrent", gated_delta_recurrent(&inputs, &starts).unwrap()),
            ("chunked 1", gated_delta_chunked(&inputs, &starts, 1).unwrap()),
            ("chunked 2", gated_delta_chunked(&inputs, &starts, 2).unwrap()),
        ] {
            assert!(rel_err(&got, &want) < CHUNKED_VS_RECURRENT_F64, "{form}: {got}");
        }
        // A document start before token 2 forgets token 1: S = 0.5 k v^T, o = 0.5 (q.k) v = 0.4 (1, -1).
        let restarted = gated_delta_recurrent(&inputs, &[true, true]).unwrap().get(1).unwrap();
        assert!(rel_err(&restarted, &tensor(vec![0.4, -0.4], &[1, 2])) < CHUNKED_VS_RECURRENT_F64);
    }

    /// The conv by hand: one channel, K = 3, taps w = (1, 2, 3) (tap 2 on the current token),
    /// x = (1, 10, 100, 1000): out = (3, 30+2, 300+20+1, 3000+200+10) = (3, 32, 321, 3210); with a
    /// document starting at token 2 the window restarts: (3, 32, 300, 3200).
    #[test]
    fn conv_by_hand() {
        let x = tensor(vec![1.0, 10.0, 100.0, 1000.0], &[4, 1]);
        let w = tensor(vec![1.0, 2.0, 3.0], &[1, 3]);
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(flat(causal_conv1d(&x, &w, &[true, false, false, false]).unwrap()), [3.0, 32.0, 321.0, 3210.0]);
        assert_eq!(flat(causal_conv1d(&x, &w, &[true, false, true, false]).unwrap()), [3.0, 32.0, 300.0, 3200.0]);
    }

    /// `repeat_heads` follows transformers' `repeat_interleave`: value head h reads key head h / group.
    #[test]
    fn repeated_heads_are_interleaved() {
        let x = tensor((0..6).map(f64::from).collect(), &[1, 3, 2]);
        let got = repeat_heads(&x, 2).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(got, [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0, 4.0, 5.0, 4.0, 5.0]);
    }

    #[test]
    fn bad_arguments_are_refused() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let inputs = random_inputs(3, 1, 2, 2, &mut rng);
        let err = gated_delta_chunked(&inputs, &[true, false, false], 0).unwrap_err().to_string();
        assert!(err.contains("chunk"), "{err}");
        let err = gated_delta_recurrent(&inputs, &[true, false]).unwrap_err().to_string();
        assert!(err.contains("starts") && err.contains("2 flags for 3 tokens"), "{err}");
        let err = causal_conv1d(&tensor(vec![1.0; 6], &[3, 2]), &tensor(vec![1.0; 3], &[1, 3]), &[true; 3])
            .unwrap_err()
            .to_string();
        assert!(err.contains("conv1d.weight"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Chunked equals recurrent within 1e-10 (f64) over lengths below, at and above the chunk,
        /// key heads dividing value heads, and packed documents (random starts).
        #[test]
        fn chunked_equals_recurrent(
            t in 1usize..150,
            chunk in prop::sample::select(vec![1usize, 3, 8, 16, 64]),
            key_heads in 1usize..3,
            group in 1usize..4,
            dk in 1usize..6,
            dv in 1usize..6,
            seed in any::<u64>(),
        ) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let heads = key_heads * group;
            let inputs = random_inputs(t, heads, dk, dv, &mut rng);
            // Up to a few documents: each token after the first starts one with probability 1/40.
            let starts: Vec<bool> = (0..t).map(|i| i == 0 || rng.random_ratio(1, 40)).collect();
            let recurrent = gated_delta_recurrent(&inputs, &starts).unwrap();
            let chunked = gated_delta_chunked(&inputs, &starts, chunk).unwrap();
            let err = rel_err(&chunked, &recurrent);
            prop_assert!(err < CHUNKED_VS_RECURRENT_F64, "rel err {err:.3e}, T {t}, chunk {chunk}, heads {heads}");
        }
    }
}
