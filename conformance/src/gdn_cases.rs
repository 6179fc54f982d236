//! The GatedDeltaNet ops of the hybrid target (`GdnOps`: conv1d + SiLU, the gates, the chunked
//! delta rule, the gated output norm, partial RoPE, the output gate) on fresh random inputs, run
//! on any backend through [`run_gdn_ops`], the outputs read back as f64 by name like
//! `op_cases::run_ops`: `xtask gpu-conformance` compares the `gdn.cu` kernels with the f64 twins,
//! CI the bf16 twins with the f64 twins (`tests/gdn_twins.rs` holds the twins to the reference).
//! The shapes are the kernels' (head dims multiples of 16): the published GatedDeltaNet dims
//! (d_k = d_v = 128, value heads sharing key heads) and small ones (d_v not a multiple of the
//! state kernel's columns), on documents that need two groups of chunks.

use std::ops::Range;

use dflash_optimized::backend::Backend;
use dflash_optimized::ops::elementwise::Heads;
use dflash_optimized::ops::gdn::{groups, segment_table, DeltaBuffers, DeltaScratch, GateInputs, GdnShape, Segments};
use dflash_optimized::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::op_cases::{draw_bf16, f32_exact, Buffers, Kind, OpOutputs};
use crate::tolerance::{GDN_DELTA_BF16, GPU_KERNEL_BF16, KERNEL_F32};

/// One GatedDeltaNet case: `(T, H_k, H_v, d_k, d_v, the documents' ends)`.
type Case = (usize, usize, usize, usize, usize, &'static [usize]);

/// `eps` of the gated output norm (the published configs' `rms_norm_eps`).
const NORM_EPS: f64 = 1e-6;

/// Documents tiling `0..t` whose lengths end at `ends` (ascending, the last `t`).
pub fn tiling(ends: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    ends.iter()
        .map(|&end| {
            let doc = start..end;
            start = end;
            doc
        })
        .collect()
}

/// `beta = sigmoid(n)` and `g = -exp(A_log) softplus(n')` as the layer makes them (fp32-exact),
/// `[T, H_v]` each.
fn gates(shape: GdnShape, rng: &mut ChaCha8Rng) -> (Vec<f64>, Vec<f64>) {
    let (t, hv) = (shape.tokens, shape.value_heads);
    let a_log = draw_bf16(hv, 0.0, 0.5, rng);
    let beta = draw_bf16(t * hv, 0.0, 1.0, rng).into_iter().map(|b| f32_exact(1.0 / (1.0 + (-b).exp()))).collect();
    let g = draw_bf16(t * hv, 0.0, 1.0, rng)
        .into_iter()
        .enumerate()
        .map(|(i, a)| f32_exact(-a_log[i % hv].exp() * (a.max(0.0) + (-a.abs()).exp().ln_1p())))
        .collect();
    (beta, g)
}

/// Runs every GatedDeltaNet op of backend `dev` on the inputs of `seed`.
pub fn run_gdn_ops<B: Backend>(dev: &B, seed: u64) -> Result<Vec<OpOutputs>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buf = Buffers::new(dev);
    let gdn = dev.gdn_ops();
    let (s, a, u) = (Kind::Stored, Kind::Acc, Kind::U32);
    let mut out = Vec::new();
    // (T, H_k, H_v, d_k, d_v, document ends): the published dims on five documents (six chunks:
    // two groups of at most four), and small dims on one document of three chunks.
    let cases: [Case; 2] = [(200, 2, 6, 128, 128, &[37, 38, 108, 137, 200]), (130, 1, 3, 32, 48, &[130])];
    for (tokens, key_heads, value_heads, key_head_dim, value_head_dim, ends) in cases {
        let shape = GdnShape { tokens, key_heads, value_heads, key_head_dim, value_head_dim, conv_kernel: 4 };
        let docs = tiling(ends);
        let table = buf.put(u, &segment_table(&docs, tokens, false).into_iter().map(f64::from).collect::<Vec<_>>())?;
        let segments = Segments { ranges: &docs, table, resume: false };
        let (c, hv, vd) = (shape.conv_channels(), value_heads, shape.value_dim());
        let label = format!("T {tokens}, H_k {key_heads}, H_v {hv}, d_k {key_head_dim}, d_v {value_head_dim}");

        let x = buf.put(s, &draw_bf16(tokens * c, 0.0, 1.0, &mut rng))?;
        let w = buf.put(s, &draw_bf16(c * shape.conv_kernel, 0.0, 0.5, &mut rng))?;
        let y = buf.zeros(s, tokens * c)?;
        gdn.conv1d_silu(x, w, y, shape, segments)?;
        out.push(OpOutputs {
            op: format!("conv1d_silu [{tokens}, {c}] docs {ends:?}"),
            outputs: vec![("y", buf.get(s, y, tokens * c)?, GPU_KERNEL_BF16)],
        });

        let inputs = GateInputs {
            b: buf.put(s, &draw_bf16(tokens * hv, 0.0, 1.0, &mut rng))?,
            a: buf.put(s, &draw_bf16(tokens * hv, 0.0, 1.0, &mut rng))?,
            a_log: buf.put(s, &draw_bf16(hv, 0.0, 0.5, &mut rng))?,
            dt_bias: buf.put(s, &draw_bf16(hv, 0.0, 0.5, &mut rng))?,
        };
        let (beta, g) = (buf.zeros(a, tokens * hv)?, buf.zeros(a, tokens * hv)?);
        gdn.gdn_gates(inputs, beta, g, shape)?;
        out.push(OpOutputs {
            op: format!("gdn_gates [{tokens}, {hv}]"),
            outputs: vec![
                ("beta", buf.get(a, beta, tokens * hv)?, KERNEL_F32),
                ("g", buf.get(a, g, tokens * hv)?, KERNEL_F32),
            ],
        });

        // The delta rule on the conv's kind of output (bf16) and the layer's kind of gates.
        let qkv = buf.put(s, &draw_bf16(tokens * c, 0.0, 1.0, &mut rng))?;
        let (beta, g) = gates(shape, &mut rng);
        let o = buf.zeros(s, tokens * vd)?;
        let bufs = DeltaBuffers { qkv, beta: buf.put(a, &beta)?, g: buf.put(a, &g)?, out: o };
        let d = shape.scratch_values();
        let scratch = DeltaScratch {
            w: buf.zeros(s, d.w)?,
            u: buf.zeros(a, d.u)?,
            states: buf.zeros(s, d.states)?,
            carry: buf.zeros(a, d.carry)?,
        };
        let groups: Vec<Range<usize>> = groups(&docs, shape).collect();
        for group in &groups {
            gdn.gated_delta(bufs, scratch, shape, segments, group.clone())?;
        }
        let carried = buf.get(a, scratch.carry, d.carry)?;
        out.push(OpOutputs {
            op: format!("gated_delta {label}, docs {ends:?} in {} groups", groups.len()),
            outputs: vec![
                ("out", buf.get(s, o, tokens * vd)?, GDN_DELTA_BF16),
                ("carried state", carried, GDN_DELTA_BF16),
            ],
        });
        // Decoding's form: the first 70 tokens as one segment resuming the state left above.
        let n = tokens.min(70);
        let one = dflash_optimized::ops::gdn::one_segment(n);
        let table = buf.put(u, &segment_table(&one, n, true).into_iter().map(f64::from).collect::<Vec<_>>())?;
        let resumed = Segments { ranges: &one, table, resume: true };
        let shape_n = GdnShape { tokens: n, ..shape };
        let resumed_out = buf.zeros(s, n * vd)?;
        for group in dflash_optimized::ops::gdn::groups(&one, shape_n) {
            gdn.gated_delta(DeltaBuffers { out: resumed_out, ..bufs }, scratch, shape_n, resumed, group)?;
        }
        out.push(OpOutputs {
            op: format!("gated_delta {label}, {n} tokens resuming that state"),
            outputs: vec![
                ("out", buf.get(s, resumed_out, n * vd)?, GDN_DELTA_BF16),
                ("carried state", buf.get(a, scratch.carry, d.carry)?, GDN_DELTA_BF16),
            ],
        });

        let z = buf.put(s, &draw_bf16(tokens * vd, 0.0, 1.0, &mut rng))?;
        let nw = buf.put(s, &draw_bf16(value_head_dim, 1.0, 0.2, &mut rng))?;
        let ny = buf.zeros(s, tokens * vd)?;
        gdn.gated_rms_norm(o, z, nw, ny, shape, NORM_EPS)?;
        out.push(OpOutputs {
            op: format!("gated_rms_norm [{tokens}, {hv}, {value_head_dim}]"),
            outputs: vec![("y", buf.get(s, ny, tokens * vd)?, GPU_KERNEL_BF16)],
        });
    }

    // Partial RoPE (a quarter of heads of 256, positions restarting) and the output gate, in place.
    let dims = Heads { tokens: rng.random_range(40..=90), heads: rng.random_range(1..=4), head_dim: 256 };
    let (t, rotary) = (dims.tokens, 64);
    let positions: Vec<usize> = (0..t).map(|i| if i < t / 3 { i } else { i - t / 3 }).collect();
    let (cos, sin) = dflash_reference::ops::rope_tables(&positions, rotary, 1e7, candle_core::DType::F64)?;
    let table = |x: candle_core::Tensor| -> Result<Vec<f64>> {
        Ok(x.flatten_all()?.to_vec1::<f64>()?.into_iter().map(f32_exact).collect())
    };
    let (cos, sin) = (buf.put(a, &table(cos)?)?, buf.put(a, &table(sin)?)?);
    let n = t * dims.heads * dims.head_dim;
    let x = buf.put(s, &draw_bf16(n, 0.0, 1.0, &mut rng))?;
    gdn.partial_rope(x, cos, sin, x, dims, rotary)?;
    out.push(OpOutputs {
        op: format!("partial_rope [{t}, {}, 256] rotary {rotary}", dims.heads),
        outputs: vec![("y", buf.get(s, x, n)?, GPU_KERNEL_BF16)],
    });
    let gate = buf.put(s, &draw_bf16(n, 0.0, 2.0, &mut rng))?;
    gdn.output_gate(x, gate, x, n)?;
    out.push(OpOutputs { op: format!("output_gate [{n}]"), outputs: vec![("y", buf.get(s, x, n)?, GPU_KERNEL_BF16)] });
    Ok(out)
}
