//! The hybrid target's other pieces (spec section 10): the zero-centred RMSNorm, the gated
//! full-attention layer with partial RoPE, and the elementwise functions they use.

use candle_core::{Tensor, D};

use super::config::HybridConfig;
use crate::attention::dense_attention;
use crate::error::Result;
use crate::ops::{linear, rms_norm, rope};

/// `1 / (1 + exp(-x))`.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok(x.neg()?.exp()?.affine(1.0, 1.0)?.recip()?)
}

/// `log(1 + exp(x))`, as `max(x, 0) + log(1 + exp(-|x|))` so that large x does not overflow.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    Ok((x.relu()? + x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)?)
}

/// The zero-centred RMSNorm of Qwen3.5 over the last dim: `y = x / sqrt(mean(x^2) + eps) * (1 + w)`
/// (w is stored centred on 0); computed in the model's dtype, f32 or f64. x `[.., n]`, w `[n]`.
pub fn zero_centred_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm(x, &w.affine(1.0, 1.0)?, eps)
}

/// RoPE (rotate_half, [`crate::ops::rope`]) on the first `cos.dim(1)` dims of each head; the rest
/// pass through. x `[T, heads, d]`, cos/sin `[T, rotary_dim]` -> `[T, heads, d]`.
pub fn partial_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (d, rotary) = (x.dim(D::Minus1)?, cos.dim(1)?);
    let rotated = rope(&x.narrow(D::Minus1, 0, rotary)?, cos, sin)?;
    if rotary == d {
        return Ok(rotated);
    }
    Ok(Tensor::cat(&[&rotated, &x.narrow(D::Minus1, rotary, d - rotary)?], D::Minus1)?)
}

/// The causal mask of a packed row `[T*T]` row-major: query i sees key j iff `j <= i` and both
/// are in the same document.
pub fn packed_causal_mask(doc_ids: &[i64]) -> Vec<bool> {
    let t = doc_ids.len();
    (0..t * t).map(|e| (e % t) <= (e / t) && doc_ids[e % t] == doc_ids[e / t]).collect()
}

/// The weights of one gated attention layer (HF names under `self_attn.`).
pub struct AttnWeights<'a> {
    /// `q_proj.weight` `[heads * 2 * head_dim, hidden]`: per head, `head_dim` query rows then
    /// `head_dim` gate rows (transformers views the output as `[.., heads, 2 * head_dim]` and splits
    /// the last dim in halves).
    pub q_proj: &'a Tensor,
    /// `k_proj.weight` `[kv_heads * head_dim, hidden]`.
    pub k_proj: &'a Tensor,
    /// `v_proj.weight` `[kv_heads * head_dim, hidden]`.
    pub v_proj: &'a Tensor,
    /// `o_proj.weight` `[hidden, heads * head_dim]`.
    pub o_proj: &'a Tensor,
    /// `q_norm.weight` `[head_dim]` (zero-centred).
    pub q_norm: &'a Tensor,
    /// `k_norm.weight` `[head_dim]` (zero-centred).
    pub k_norm: &'a Tensor,
}

/// The gated attention token mixer on the normed input x `[T, hidden]`: queries and gate from
/// `q_proj`, zero-centred q/k norms over `head_dim`, partial RoPE (cos/sin `[T, rotary_dim]`),
/// GQA softmax attention with scale `head_dim^-0.5` under `mask` `[T*T]`, the output times
/// `sigmoid(gate)` elementwise, `o_proj`. Returns `[T, hidden]`.
pub fn gated_attention(
    x: &Tensor,
    w: &AttnWeights,
    c: &HybridConfig,
    cos: &Tensor,
    sin: &Tensor,
    mask: &[bool],
) -> Result<Tensor> {
    let (t, d, eps) = (x.dim(0)?, c.head_dim, c.rms_norm_eps);
    let query_and_gate = linear(x, w.q_proj)?.reshape((t, c.num_heads, 2 * d))?;
    let q = zero_centred_rms_norm(&query_and_gate.narrow(2, 0, d)?, w.q_norm, eps)?;
    let gate = query_and_gate.narrow(2, d, d)?.reshape((t, c.num_heads * d))?;
    let k = zero_centred_rms_norm(&linear(x, w.k_proj)?.reshape((t, c.num_kv_heads, d))?, w.k_norm, eps)?;
    let v = linear(x, w.v_proj)?.reshape((t, c.num_kv_heads, d))?;
    let (q, k) = (partial_rope(&q, cos, sin)?, partial_rope(&k, cos, sin)?);
    let attn = dense_attention(&q, &k, &v, mask)?.reshape((t, c.num_heads * d))?;
    linear(&(attn * sigmoid(&gate)?)?, w.o_proj)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// f64 elementwise math against the same formula written with scalars: rounding only.
    const SCALAR_F64: f64 = 1e-12;

    /// x = (3, 4), w = (0.5, -0.5), eps = 0: rms = sqrt(12.5), y = (3 * 1.5, 4 * 0.5) / sqrt(12.5).
    #[test]
    fn zero_centred_norm_by_hand() {
        let x = Tensor::new(&[3.0f64, 4.0], &Device::Cpu).unwrap();
        let w = Tensor::new(&[0.5f64, -0.5], &Device::Cpu).unwrap();
        let got = zero_centred_rms_norm(&x, &w, 0.0).unwrap().to_vec1::<f64>().unwrap();
        let rms = 12.5f64.sqrt();
        for (g, want) in got.iter().zip([4.5 / rms, 2.0 / rms]) {
            assert!((g - want).abs() < SCALAR_F64, "{got:?}");
        }
    }

    /// Random rows: `x_i / sqrt(mean(x^2) + eps) * (1 + w_i)` per row, with nonzero w (a norm that
    /// forgot the `1 +` would be off by the whole input).
    #[test]
    fn zero_centred_norm_random_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (rows, n, eps) = (5, 7, 1e-6);
        let x: Vec<f64> = (0..rows * n).map(|_| rng.sample(rand_distr::StandardNormal)).collect();
        let w: Vec<f64> = (0..n).map(|_| 0.3 * rng.sample::<f64, _>(rand_distr::StandardNormal)).collect();
        let xt = Tensor::from_vec(x.clone(), (rows, n), &Device::Cpu).unwrap();
        let wt = Tensor::from_vec(w.clone(), n, &Device::Cpu).unwrap();
        let got = zero_centred_rms_norm(&xt, &wt, eps).unwrap().to_vec2::<f64>().unwrap();
        for r in 0..rows {
            let row = &x[r * n..(r + 1) * n];
            let inv_rms = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt();
            for i in 0..n {
                assert!((got[r][i] - row[i] * inv_rms * (1.0 + w[i])).abs() < SCALAR_F64);
            }
        }
    }

    #[test]
    fn softplus_and_sigmoid_are_stable() {
        let x = Tensor::new(&[-800.0f64, -1.0, 0.0, 2.0, 800.0], &Device::Cpu).unwrap();
        let sp = softplus(&x).unwrap().to_vec1::<f64>().unwrap();
        let sg = sigmoid(&x).unwrap().to_vec1::<f64>().unwrap();
        let want_sp = [0.0, (1.0 + (-1.0f64).exp()).ln(), 2f64.ln(), (1.0 + 2f64.exp()).ln(), 800.0];
        let want_sg = [0.0, 1.0 / (1.0 + 1f64.exp()), 0.5, 1.0 / (1.0 + (-2f64).exp()), 1.0];
        for i in 0..5 {
            assert!(
                (sp[i] - want_sp[i]).abs() < SCALAR_F64 && (sg[i] - want_sg[i]).abs() < SCALAR_F64,
                "{sp:?} {sg:?}"
            );
        }
    }

    /// Partial RoPE leaves the dims past `rotary_dim` untouched and rotates the first ones.
    #[test]
    fn partial_rope_passes_the_tail() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (t, heads, d, rotary) = (3, 2, 8, 4);
        let x: Vec<f64> = (0..t * heads * d).map(|_| rng.sample(rand_distr::StandardNormal)).collect();
        let x = Tensor::from_vec(x, (t, heads, d), &Device::Cpu).unwrap();
        let (cos, sin) = crate::ops::rope_tables(&[0, 1, 2], rotary, 1e4, candle_core::DType::F64).unwrap();
        let y = partial_rope(&x, &cos, &sin).unwrap();
        let tail =
            |a: &Tensor| a.narrow(2, rotary, d - rotary).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(tail(&y), tail(&x));
        let head = rope(&x.narrow(2, 0, rotary).unwrap(), &cos, &sin).unwrap();
        assert_eq!(
            y.narrow(2, 0, rotary).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            head.flatten_all().unwrap().to_vec1::<f64>().unwrap()
        );
    }

    #[test]
    fn packed_mask_is_causal_within_documents() {
        let mask = packed_causal_mask(&[0, 0, 1, -1]);
        #[rustfmt::skip]
        let want = [
            true, false, false, false,
            true, true, false, false,
            false, false, true, false,
            false, false, false, true,
        ];
        assert_eq!(mask, want);
    }
}
