//! Every elementwise op and the matmul on fresh random inputs, run on any backend: the same
//! inputs (stored values bf16-exact, arithmetic values f32-exact) drawn from a seed, the outputs
//! read back as f64 by name. `xtask gpu-conformance` compares the CUDA kernels with the one set of
//! CPU twins (`Host<f64>`); CI compares the bf16 twins with the f64 twins, and `tests/twins.rs`
//! holds the f64 twins to the reference.

use dflash_optimized::backend::{download, Allocation, Backend};
use dflash_optimized::ops::constants::{GRAD_PARTS, LINEAR_ROWS, NORM_PARTS};
use dflash_optimized::ops::elementwise::{
    AdamWArgs, AdamWBuffers, CeRows, ElementwiseOps, HeadNormRope, HeadNormRopeGrad, Heads, RmsNormGrad,
};
use dflash_optimized::ops::matmul::Mat;
use dflash_optimized::ops::{Elem, Real};
use dflash_optimized::Result;

use crate::tolerance::{Tolerance, ADAMW_F32, EXACT, GPU_KERNEL_BF16, KERNEL_F32};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// How a buffer holds its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The backend's stored type.
    Stored,
    /// The backend's arithmetic type.
    Acc,
    U32,
}

/// Buffers on a backend, freed together.
pub struct Buffers<'a, B: Backend> {
    dev: &'a B,
    held: Vec<B::Alloc>,
}

impl<'a, B: Backend> Buffers<'a, B> {
    pub fn new(dev: &'a B) -> Self {
        Buffers { dev, held: Vec::new() }
    }

    fn width(kind: Kind) -> usize {
        match kind {
            Kind::Stored => B::Elem::BYTES,
            Kind::Acc => <B::Elem as Elem>::Acc::BYTES,
            Kind::U32 => 4,
        }
    }

    /// A buffer holding `values` as `kind`.
    pub fn put(&mut self, kind: Kind, values: &[f64]) -> Result<u64> {
        let ptr = self.zeros(kind, values.len())?;
        let bytes: Vec<u8> = match kind {
            Kind::Stored => bytes_of(&values.iter().map(|&x| B::Elem::from_f64(x)).collect::<Vec<_>>()),
            Kind::Acc => bytes_of(&values.iter().map(|&x| <B::Elem as Elem>::Acc::from_f64(x)).collect::<Vec<_>>()),
            Kind::U32 => bytes_of(&values.iter().map(|&x| x as u32).collect::<Vec<_>>()),
        };
        self.dev.upload(ptr, &bytes)?;
        Ok(ptr)
    }

    /// A zeroed buffer of `n` values of `kind`.
    pub fn zeros(&mut self, kind: Kind, n: usize) -> Result<u64> {
        let a = self.dev.alloc("op case", n.max(1) * Self::width(kind))?;
        let ptr = a.ptr();
        self.held.push(a);
        Ok(ptr)
    }

    /// `n` values of `kind` at `ptr`, as f64.
    pub fn get(&self, kind: Kind, ptr: u64, n: usize) -> Result<Vec<f64>> {
        Ok(match kind {
            Kind::Stored => download::<B::Elem, B>(self.dev, ptr, n)?.into_iter().map(Elem::to_f64).collect(),
            Kind::Acc => {
                download::<<B::Elem as Elem>::Acc, B>(self.dev, ptr, n)?.into_iter().map(Real::to_f64).collect()
            }
            Kind::U32 => download::<u32, B>(self.dev, ptr, n)?.into_iter().map(f64::from).collect(),
        })
    }
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain-old-data values viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }.to_vec()
}

/// `n` normal values `mean + std * z`, rounded to bf16 (stored inputs).
pub fn draw_bf16(n: usize, mean: f64, std: f64, rng: &mut ChaCha8Rng) -> Vec<f64> {
    (0..n)
        .map(|_| half::bf16::from_f64(mean + std * Distribution::<f64>::sample(&StandardNormal, rng)).to_f64())
        .collect()
}

/// `x` rounded to f32 (arithmetic-type inputs).
pub fn f32_exact(x: f64) -> f64 {
    f64::from(x as f32)
}

/// The inverse RMS of each `n`-value row of `x`, f32-exact (the backward's saved input).
fn inv_rms(x: &[f64], n: usize, eps: f64) -> Vec<f64> {
    x.chunks(n).map(|r| f32_exact(1.0 / (r.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt())).collect()
}

/// One op's outputs by name, each with the tolerance its kind of value allows against the f64
/// twin: stored bf16 values, arithmetic (fp32) values, exact copies.
pub struct OpOutputs {
    pub op: String,
    pub outputs: Vec<(&'static str, Vec<f64>, Tolerance)>,
}

/// Runs every elementwise op and the matmul of backend `dev` on the inputs of `seed`.
pub fn run_ops<B: Backend>(dev: &B, seed: u64) -> Result<Vec<OpOutputs>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buf = Buffers::new(dev);
    let ops = dev.ops();
    let mut out = Vec::new();
    let eps = 1e-6;
    let (s, a, u) = (Kind::Stored, Kind::Acc, Kind::U32);

    // RMSNorm forward and backward (with the residual gradient).
    let (rows, n) = (rng.random_range(1..=70), 64 * rng.random_range(1..=80));
    let x = draw_bf16(rows * n, 0.0, 1.5, &mut rng);
    let w = draw_bf16(n, 1.0, 0.3, &mut rng);
    let (xb, wb) = (buf.put(s, &x)?, buf.put(s, &w)?);
    let (y, inv) = (buf.zeros(s, rows * n)?, buf.zeros(a, rows)?);
    ops.rms_norm_forward(xb, wb, y, inv, rows, n, eps)?;
    out.push(OpOutputs {
        op: format!("rms_norm_forward [{rows}, {n}]"),
        outputs: vec![("y", buf.get(s, y, rows * n)?, GPU_KERNEL_BF16), ("inv", buf.get(a, inv, rows)?, KERNEL_F32)],
    });
    let (dy, dres) = (draw_bf16(rows * n, 0.0, 1.0, &mut rng), draw_bf16(rows * n, 0.0, 1.0, &mut rng));
    let g = RmsNormGrad {
        dy: buf.put(s, &dy)?,
        x: xb,
        w: wb,
        inv: buf.put(a, &inv_rms(&x, n, eps))?,
        dres: Some(buf.put(s, &dres)?),
    };
    let (dx, dw, partial) = (buf.zeros(s, rows * n)?, buf.zeros(s, n)?, buf.zeros(a, GRAD_PARTS * n)?);
    ops.rms_norm_backward(g, dx, dw, partial, rows, n)?;
    out.push(OpOutputs {
        op: format!("rms_norm_backward [{rows}, {n}]"),
        outputs: vec![("dx", buf.get(s, dx, rows * n)?, GPU_KERNEL_BF16), ("dw", buf.get(s, dw, n)?, GPU_KERNEL_BF16)],
    });

    // Head norm + RoPE forward and backward.
    let dims = Heads {
        tokens: rng.random_range(1..=90),
        heads: rng.random_range(1..=5),
        head_dim: 64 * rng.random_range(1..=4),
    };
    let (t, d, m) = (dims.tokens, dims.head_dim, dims.tokens * dims.heads * dims.head_dim);
    let positions: Vec<usize> = (0..t).map(|_| rng.random_range(0..5000)).collect();
    let (cos, sin) = dflash_reference::ops::rope_tables(&positions, d, 1e6, candle_core::DType::F64)?;
    let table = |x: candle_core::Tensor| -> Result<Vec<f64>> {
        Ok(x.flatten_all()?.to_vec1::<f64>()?.into_iter().map(f32_exact).collect())
    };
    let (cos, sin) = (table(cos)?, table(sin)?);
    let hx = draw_bf16(m, 0.0, 2.0, &mut rng);
    let hw = draw_bf16(d, 1.0, 0.3, &mut rng);
    let row = dims.heads * d;
    let f = HeadNormRope {
        x: buf.put(s, &hx)?,
        x_row: row,
        w: buf.put(s, &hw)?,
        cos: buf.put(a, &cos)?,
        sin: buf.put(a, &sin)?,
    };
    let (hy, hinv) = (buf.zeros(s, m)?, buf.zeros(a, t * dims.heads)?);
    ops.head_norm_rope_forward(f, hy, hinv, dims, eps)?;
    let label = format!("[{t}, {}, {d}]", dims.heads);
    out.push(OpOutputs {
        op: format!("head_norm_rope_forward {label}"),
        outputs: vec![
            ("y", buf.get(s, hy, m)?, GPU_KERNEL_BF16),
            ("inv", buf.get(a, hinv, t * dims.heads)?, KERNEL_F32),
        ],
    });
    let ry = buf.zeros(s, m)?;
    ops.rope_forward(f.x, row, f.cos, f.sin, ry, dims)?;
    out.push(OpOutputs {
        op: format!("rope_forward {label}"),
        outputs: vec![("y", buf.get(s, ry, m)?, GPU_KERNEL_BF16)],
    });
    // The same heads read as the leading columns of wider rows (the q or k of a stacked
    // [q | k | v] projection): x's tokens `wide` values apart, the gap filled with other values.
    let wide = row + 8 * rng.random_range(1..=64);
    let hx_wide: Vec<f64> = (0..t)
        .flat_map(|tok| {
            let mut r = hx[tok * row..(tok + 1) * row].to_vec();
            r.extend(draw_bf16(wide - row, 0.0, 2.0, &mut rng));
            r
        })
        .collect();
    let fw = HeadNormRope { x: buf.put(s, &hx_wide)?, x_row: wide, ..f };
    let (wy, winv, wry) = (buf.zeros(s, m)?, buf.zeros(a, t * dims.heads)?, buf.zeros(s, m)?);
    ops.head_norm_rope_forward(fw, wy, winv, dims, eps)?;
    ops.rope_forward(fw.x, wide, fw.cos, fw.sin, wry, dims)?;
    out.push(OpOutputs {
        op: format!("head_norm_rope_forward and rope_forward {label}, x rows {wide} apart"),
        outputs: vec![
            ("y", buf.get(s, wy, m)?, GPU_KERNEL_BF16),
            ("inv", buf.get(a, winv, t * dims.heads)?, KERNEL_F32),
            ("rope y", buf.get(s, wry, m)?, GPU_KERNEL_BF16),
        ],
    });
    let hdy = draw_bf16(m, 0.0, 1.0, &mut rng);
    let g = HeadNormRopeGrad { dy: buf.put(s, &hdy)?, fwd: f, inv: buf.put(a, &inv_rms(&hx, d, eps))? };
    let (hdx, hdw, hpartial) = (buf.zeros(s, m)?, buf.zeros(s, d)?, buf.zeros(a, GRAD_PARTS * d)?);
    ops.head_norm_rope_backward(g, hdx, hdw, hpartial, dims)?;
    out.push(OpOutputs {
        op: format!("head_norm_rope_backward {label}"),
        outputs: vec![("dx", buf.get(s, hdx, m)?, GPU_KERNEL_BF16), ("dw", buf.get(s, hdw, d)?, GPU_KERNEL_BF16)],
    });

    // SwiGLU over [gate | up] rows, in place as the step runs it; an intermediate size of a
    // multiple of 8 (16-byte loads) and one of another size.
    let inter8 = 8 * rng.random_range(1..=200);
    for inter in [inter8, inter8 + rng.random_range(1..8)] {
        let rows = rng.random_range(1..=90);
        let gu = [draw_bf16(rows * inter, 0.0, 2.0, &mut rng), draw_bf16(rows * inter, 0.0, 1.0, &mut rng)];
        let gate_up: Vec<f64> =
            (0..rows).flat_map(|r| [&gu[0][r * inter..][..inter], &gu[1][r * inter..][..inter]].concat()).collect();
        let dh = draw_bf16(rows * inter, 0.0, 1.0, &mut rng);
        let (gub, dhb, h) = (buf.put(s, &gate_up)?, buf.put(s, &dh)?, buf.zeros(s, rows * inter)?);
        ops.swiglu_forward(gub, h, rows, inter)?;
        let h_out = buf.get(s, h, rows * inter)?;
        ops.swiglu_backward(dhb, gub, rows, inter)?;
        out.push(OpOutputs {
            op: format!("swiglu forward/backward [{rows}, 2 x {inter}]"),
            outputs: vec![
                ("h", h_out, GPU_KERNEL_BF16),
                ("dgate | dup", buf.get(s, gub, 2 * rows * inter)?, GPU_KERNEL_BF16),
            ],
        });
    }

    // CE gradient rows, in place over the logits; a vocab of a multiple of 8 and one of another.
    let vocab8 = 8 * rng.random_range(1..=20_000);
    for vocab in [vocab8, vocab8 + rng.random_range(1..8)] {
        let ce_rows = rng.random_range(1..=9);
        let z = draw_bf16(ce_rows * vocab, 0.0, 3.0, &mut rng);
        let labels: Vec<f64> = (0..ce_rows).map(|_| rng.random_range(0..vocab) as f64).collect();
        let weights: Vec<f64> = (0..ce_rows).map(|_| f32_exact(rng.random_range(0.1..1.0))).collect();
        let scale = f64::from(rng.random_range(0.01f32..1.0));
        let (zb, lb, wb) = (buf.put(s, &z)?, buf.put(u, &labels)?, buf.put(a, &weights)?);
        let loss = buf.zeros(a, ce_rows)?;
        ops.ce_grad_rows(CeRows { z: zb, labels: lb, weights: wb, loss }, ce_rows, vocab, scale)?;
        out.push(OpOutputs {
            op: format!("ce_grad_rows [{ce_rows}, {vocab}]"),
            outputs: vec![
                ("dz", buf.get(s, zb, ce_rows * vocab)?, GPU_KERNEL_BF16),
                ("loss", buf.get(a, loss, ce_rows)?, KERNEL_F32),
            ],
        });
    }

    // AdamW: two updates from zero moments, with clipping, from gradients in the arithmetic type
    // (accumulated) and in the stored type (a step's own: `adamw_update_bf16_grad` on the GPU).
    for g_is_stored in [false, true] {
        let pn = rng.random_range(1..=50_000);
        let p0: Vec<f64> = draw_bf16(pn, 0.0, 1.0, &mut rng);
        let b = AdamWBuffers {
            p: buf.put(a, &p0)?,
            g: 0,
            g_is_stored,
            m: buf.zeros(a, pn)?,
            v: buf.zeros(a, pn)?,
            p_stored: buf.zeros(s, pn)?,
        };
        for step in 1..=2 {
            let grads = draw_bf16(pn, 0.0, 1.0, &mut rng);
            let g = buf.put(if g_is_stored { s } else { a }, &grads)?;
            let args = AdamWArgs {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                bc1: 1.0 - 0.9f64.powi(step),
                bc2: 1.0 - 0.999f64.powi(step),
                grad_scale: 0.5,
            };
            ops.adamw_update(AdamWBuffers { g, ..b }, pn, args)?;
        }
        let p = buf.get(a, b.p, pn)?;
        let name = if g_is_stored { "adamw_update (stored gradients)" } else { "adamw_update" };
        out.push(OpOutputs {
            op: format!("{name} x2 [{pn}]"),
            outputs: vec![
                ("update", p.iter().zip(&p0).map(|(x, y)| x - y).collect(), ADAMW_F32),
                ("p_stored", buf.get(s, b.p_stored, pn)?, GPU_KERNEL_BF16),
            ],
        });
    }

    // Random fill, row gather/scatter, sums of squares, accumulation.
    let n = rng.random_range(1..=100_000);
    let fill = buf.zeros(s, n)?;
    ops.fill_normal(fill, n, rng.random::<u64>(), 0.5, 2.0)?;
    let (src_rows, cols) = (rng.random_range(2..=50), rng.random_range(1..=700));
    let src = buf.put(s, &draw_bf16(src_rows * cols, 0.0, 1.0, &mut rng))?;
    let idx: Vec<f64> = (0..src_rows).filter(|_| rng.random_bool(0.6)).map(|r| r as f64).collect();
    let (idxb, gathered, scattered) =
        (buf.put(u, &idx)?, buf.zeros(s, idx.len() * cols)?, buf.zeros(s, src_rows * cols)?);
    ops.copy_rows(false, src, idxb, gathered, idx.len(), cols)?;
    ops.copy_rows(true, gathered, idxb, scattered, idx.len(), cols)?;
    let (sx_acc, sx_stored) =
        (buf.put(a, &draw_bf16(n, 0.0, 3.0, &mut rng))?, buf.put(s, &draw_bf16(n, 0.0, 3.0, &mut rng))?);
    let partial = buf.zeros(a, NORM_PARTS)?;
    ops.sum_squares(false, sx_acc, partial, n, NORM_PARTS)?;
    let sq_acc: f64 = buf.get(a, partial, NORM_PARTS)?.iter().sum();
    ops.sum_squares(true, sx_stored, partial, n, NORM_PARTS)?;
    let sq_stored: f64 = buf.get(a, partial, NORM_PARTS)?.iter().sum();
    let acc = buf.put(a, &draw_bf16(n, 0.0, 1.0, &mut rng))?;
    ops.accumulate(acc, sx_stored, n)?;
    out.push(OpOutputs {
        op: format!("fill_normal, gather/scatter, sum_squares, accumulate [{n}]"),
        outputs: vec![
            ("fill", buf.get(s, fill, n)?, GPU_KERNEL_BF16),
            ("gather", buf.get(s, gathered, idx.len() * cols)?, EXACT),
            ("scatter", buf.get(s, scattered, src_rows * cols)?, EXACT),
            ("sum_squares", vec![sq_acc], KERNEL_F32),
            ("sum_squares stored", vec![sq_stored], KERNEL_F32),
            ("accumulate", buf.get(a, acc, n)?, KERNEL_F32),
        ],
    });

    // The matmul in the step's three forms (linear, input gradient with beta, weight gradient).
    let (mm, kk, nn) = (rng.random_range(1..=300), 8 * rng.random_range(1..=40), 8 * rng.random_range(1..=40));
    let (xa, wa, ya) = (
        buf.put(s, &draw_bf16(mm * kk, 0.0, 1.0, &mut rng))?,
        buf.put(s, &draw_bf16(nn * kk, 0.0, 1.0, &mut rng))?,
        buf.put(s, &draw_bf16(mm * nn, 0.0, 1.0, &mut rng))?,
    );
    let (lin, dx, dw) = (buf.zeros(s, mm * nn)?, ya, buf.zeros(s, nn * kk)?);
    let dxo = buf.put(s, &draw_bf16(mm * kk, 0.0, 1.0, &mut rng))?;
    dev.matmul(Mat::n(xa, mm, kk), Mat::t(wa, nn, kk), lin, 0.0)?;
    dev.matmul(Mat::n(dx, mm, nn), Mat::n(wa, nn, kk), dxo, 1.0)?;
    dev.matmul(Mat::t(dx, mm, nn), Mat::n(xa, mm, kk), dw, 0.0)?;
    out.push(OpOutputs {
        op: format!("matmul [{mm}, {kk}] x [{nn}, {kk}]^T, input and weight gradients"),
        outputs: vec![
            ("linear", buf.get(s, lin, mm * nn)?, GPU_KERNEL_BF16),
            ("input grad + beta", buf.get(s, dxo, mm * kk)?, GPU_KERNEL_BF16),
            ("weight grad", buf.get(s, dw, nn * kk)?, GPU_KERNEL_BF16),
        ],
    });

    // A few rows through `Backend::linear` (the GPU's decoding kernel `linear_rows`, 1 to
    // LINEAR_ROWS rows) with beta 0 and 1 (the residual), K past several 256-value
    // strides of a warp and never a multiple of 32 (a chunk's tail), N never a multiple of 32 (a
    // CTA's columns).
    let (kr, nr) = (
        32 * rng.random_range(75..=175) + 8 * rng.random_range(1..4),
        32 * rng.random_range(0..=90) + rng.random_range(1..32),
    );
    let wr = buf.put(s, &draw_bf16(nr * kr, 0.0, 1.0, &mut rng))?;
    for mr in [1, rng.random_range(2..LINEAR_ROWS), LINEAR_ROWS] {
        let (xr, yr) = (
            buf.put(s, &draw_bf16(mr * kr, 0.0, 1.0, &mut rng))?,
            buf.put(s, &draw_bf16(mr * nr, 0.0, 1.0, &mut rng))?,
        );
        let fresh = buf.zeros(s, mr * nr)?;
        dev.linear(xr, mr, kr, wr, nr, fresh, 0.0)?;
        dev.linear(xr, mr, kr, wr, nr, yr, 1.0)?;
        out.push(OpOutputs {
            op: format!("linear of {mr} rows [{mr}, {kr}] x [{nr}, {kr}]^T"),
            outputs: vec![
                ("linear", buf.get(s, fresh, mr * nr)?, GPU_KERNEL_BF16),
                ("linear + beta", buf.get(s, yr, mr * nr)?, GPU_KERNEL_BF16),
            ],
        });
    }

    // The rows' argmax, exact: a vocab of a multiple of 8 and one of another, on bf16 values
    // (exact in every storage) with deliberate ties (the maximum copied to a later and to an
    // earlier index) and NaNs (skipped; a row starting with one gives 0).
    let vocab8 = 8 * rng.random_range(1..=20_000);
    for vocab in [vocab8, vocab8 + rng.random_range(1..8)] {
        let am_rows = rng.random_range(6..=40);
        let mut z = draw_bf16(am_rows * vocab, 0.0, 3.0, &mut rng);
        for (r, row) in z.chunks_mut(vocab).enumerate() {
            let first = (1..vocab).fold(0, |m, i| if row[i] > row[m] { i } else { m });
            match r % 6 {
                1 if first + 1 < vocab => row[rng.random_range(first + 1..vocab)] = row[first],
                2 if first > 0 => row[rng.random_range(0..first)] = row[first],
                3 => row[rng.random_range(0..vocab)] = f64::NAN,
                4 => row[0] = f64::NAN,
                _ => {}
            }
        }
        let (zb, idx) = (buf.put(s, &z)?, buf.zeros(u, am_rows)?);
        ops.argmax_rows(zb, am_rows, vocab, idx)?;
        out.push(OpOutputs {
            op: format!("argmax_rows [{am_rows}, {vocab}]"),
            outputs: vec![("index", buf.get(u, idx, am_rows)?, EXACT)],
        });
    }
    Ok(out)
}
