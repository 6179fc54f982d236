//! The CPU twins of the GatedDeltaNet ops ([`GdnOps`]) on the flat layouts of `super`, in the
//! storage's arithmetic type (`Elem::Acc`: f32 for bf16 and f32 storage, f64 for f64 storage, the
//! twins against the reference). Addresses are host pointers read and written value by value
//! (`ld`/`st` of the elementwise twins). The delta rule runs one value head at a time on that
//! head's scratch rows and state, as one block of a kernel would; the per-chunk values a kernel
//! keeps in shared memory (cumulative decays, beta, inverse norms, the `[C, C]` tile of the UT
//! inverse and then of P) are stack arrays of [`GDN_CHUNK`]. Nothing allocates.

use std::marker::PhantomData;
use std::ops::Range;

use dflash_reference::hybrid::gdn::L2_NORM_EPS;

use super::{check_group, chunks, DeltaBuffers, DeltaScratch, GateInputs, GdnOps, GdnShape, Segments, GDN_CHUNK};
use crate::ops::elementwise::twin::{ld, lda, st, sta};
use crate::ops::elementwise::Heads;
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// The CPU twins on values stored as `E`.
pub struct GdnTwin<E>(PhantomData<E>);

impl<E> Default for GdnTwin<E> {
    fn default() -> Self {
        GdnTwin(PhantomData)
    }
}

fn sigmoid<A: Real>(x: A) -> A {
    A::ONE / (A::ONE + (-x).exp())
}

fn silu<A: Real>(x: A) -> A {
    x * sigmoid(x)
}

/// `log(1 + exp(x))` as `max(x, 0) + log(1 + exp(-|x|))` (the reference's form: no overflow).
fn softplus<A: Real>(x: A) -> A {
    let (positive, abs) = if x > A::ZERO { (x, x) } else { (A::ZERO, -x) };
    positive + (A::ONE + (-abs).exp()).ln()
}

/// One value head `h` of one [`GdnOps::gated_delta`] call: its addresses and sizes.
struct Head<E> {
    b: DeltaBuffers,
    shape: GdnShape,
    h: usize,
    /// Columns of `qkv` before this head's q, k and v.
    q0: usize,
    k0: usize,
    v0: usize,
    /// This head's W `[T, d_k]` (stored), U then Delta `[T, d_v]`, entering states
    /// `[state_slots, d_k, d_v]` (stored) and carried state `[d_k, d_v]`.
    w: u64,
    u: u64,
    states: u64,
    carry: u64,
    stored: PhantomData<E>,
}

impl<E: Elem> Head<E> {
    fn new(b: DeltaBuffers, s: DeltaScratch, shape: GdnShape, h: usize) -> Self {
        let (t, dk, dv) = (shape.tokens, shape.key_head_dim, shape.value_head_dim);
        let kh = h / (shape.value_heads / shape.key_heads);
        let (e, a) = (E::BYTES as u64, std::mem::size_of::<E::Acc>() as u64);
        Head {
            b,
            shape,
            h,
            q0: kh * dk,
            k0: shape.key_dim() + kh * dk,
            v0: 2 * shape.key_dim() + h * dv,
            w: s.w + (h * t * dk) as u64 * e,
            u: s.u + (h * t * dv) as u64 * a,
            states: s.states + (h * shape.state_slots() * dk * dv) as u64 * e,
            carry: s.carry + (h * dk * dv) as u64 * a,
            stored: PhantomData,
        }
    }

    fn q(&self, t: usize, c: usize) -> E::Acc {
        ld::<E>(self.b.qkv, t * self.shape.conv_channels() + self.q0 + c)
    }

    fn k(&self, t: usize, c: usize) -> E::Acc {
        ld::<E>(self.b.qkv, t * self.shape.conv_channels() + self.k0 + c)
    }

    fn v(&self, t: usize, c: usize) -> E::Acc {
        ld::<E>(self.b.qkv, t * self.shape.conv_channels() + self.v0 + c)
    }

    /// W's value `(t, a)`, as stored.
    fn w(&self, t: usize, a: usize) -> E::Acc {
        ld::<E>(self.w, t * self.shape.key_head_dim + a)
    }

    /// U's (then Delta's) value `(t, c)`.
    fn u(&self, t: usize, c: usize) -> E::Acc {
        lda(self.u, t * self.shape.value_head_dim + c)
    }

    fn set_u(&self, t: usize, c: usize, v: E::Acc) {
        sta(self.u, t * self.shape.value_head_dim + c, v)
    }

    /// The carried state's value `(a, c)`.
    fn s(&self, a: usize, c: usize) -> E::Acc {
        lda(self.carry, a * self.shape.value_head_dim + c)
    }

    fn set_s(&self, a: usize, c: usize, v: E::Acc) {
        sta(self.carry, a * self.shape.value_head_dim + c, v)
    }

    /// The stored entering state of group slot `slot`, value `(a, c)`.
    fn entering(&self, slot: usize, a: usize, c: usize) -> E::Acc {
        ld::<E>(self.states, (slot * self.shape.key_head_dim + a) * self.shape.value_head_dim + c)
    }

    /// `1 / sqrt(sum(x^2) + eps)` of the `d_k` values `x(c)`.
    fn inv_l2(&self, x: impl Fn(usize) -> E::Acc) -> E::Acc {
        let ss = (0..self.shape.key_head_dim).fold(E::Acc::ZERO, |s, c| s + x(c) * x(c));
        E::Acc::ONE / (ss + E::Acc::from_f64(L2_NORM_EPS)).sqrt()
    }

    /// The carried state: zero where a document starts, then stored to group slot `slot` (the
    /// state entering the chunk).
    fn enter(&self, restart: bool, slot: usize) {
        let (dk, dv) = (self.shape.key_head_dim, self.shape.value_head_dim);
        for a in 0..dk {
            for c in 0..dv {
                if restart {
                    self.set_s(a, c, E::Acc::ZERO);
                }
                st::<E>(self.states, (slot * dk + a) * dv + c, self.s(a, c));
            }
        }
    }

    /// The `n` tokens from `begin` (one chunk of one document, group slot `slot`) through the UT
    /// form of `reference::hybrid::gdn::gated_delta_chunked`, the carried state entering as `S_0`
    /// (its stored copy in the slot where it multiplies W and Q, as the kernels' operands) and
    /// leaving as `S_n`. The chunk's `[C, C]` matrices (the UT inverse `T = (I + A)^-1`, solved
    /// in place over A, then `P = (Q K^T) * D`) are a kernel's shared tile, here on the stack.
    fn chunk(&self, begin: usize, n: usize, slot: usize) {
        let (dk, dv, hv, h) = (self.shape.key_head_dim, self.shape.value_head_dim, self.shape.value_heads, self.h);
        let scale = E::Acc::from_f64((dk as f64).powf(-0.5));
        let (mut gamma, mut beta) = ([E::Acc::ZERO; GDN_CHUNK], [E::Acc::ZERO; GDN_CHUNK]);
        let (mut q_inv, mut k_inv) = ([E::Acc::ZERO; GDN_CHUNK], [E::Acc::ZERO; GDN_CHUNK]);
        let mut tile = [[E::Acc::ZERO; GDN_CHUNK]; GDN_CHUNK];
        let mut decay = E::Acc::ZERO;
        for i in 0..n {
            let t = begin + i;
            decay += lda::<E::Acc>(self.b.g, t * hv + h);
            gamma[i] = decay;
            beta[i] = lda(self.b.beta, t * hv + h);
            q_inv[i] = self.inv_l2(|c| self.q(t, c)) * scale;
            k_inv[i] = self.inv_l2(|c| self.k(t, c));
        }
        let row = |i: usize| begin + i;
        // k_i . k_j and q_i . k_j of the normed (and scaled) vectors.
        let kk = |i: usize, j: usize| {
            (0..dk).fold(E::Acc::ZERO, |s, c| s + self.k(row(i), c) * self.k(row(j), c)) * k_inv[i] * k_inv[j]
        };
        let qk = |i: usize, j: usize| {
            (0..dk).fold(E::Acc::ZERO, |s, c| s + self.q(row(i), c) * self.k(row(j), c)) * q_inv[i] * k_inv[j]
        };
        // A_ij = beta_i exp(gamma_i - gamma_j) k_i . k_j (j < i), then row i of T by forward
        // substitution: T_im = -sum_{m <= j < i} A_ij T_jm, T_ii = 1; A_im is read before T_im
        // overwrites it and never after.
        for i in 0..n {
            for j in 0..i {
                tile[i][j] = beta[i] * (gamma[i] - gamma[j]).exp() * kk(i, j);
            }
            for m in 0..i {
                let t_im = (m..i).fold(E::Acc::ZERO, |s, j| s + tile[i][j] * tile[j][m]);
                tile[i][m] = -t_im;
            }
            tile[i][i] = E::Acc::ONE;
        }
        // W = T (beta exp(gamma) K) (stored), U = T (beta V).
        for (i, t_row) in tile.iter().enumerate().take(n) {
            let t_ij = |j: usize| t_row[j] * beta[j];
            for c in 0..dk {
                let w = (0..=i).fold(E::Acc::ZERO, |s, j| s + t_ij(j) * gamma[j].exp() * self.k(row(j), c) * k_inv[j]);
                st::<E>(self.w, row(i) * dk + c, w);
            }
            for c in 0..dv {
                self.set_u(row(i), c, (0..=i).fold(E::Acc::ZERO, |s, j| s + t_ij(j) * self.v(row(j), c)));
            }
        }
        // Delta = U - W S_0 (over U); P over T.
        for i in 0..n {
            for c in 0..dv {
                let ws = (0..dk).fold(E::Acc::ZERO, |s, a| s + self.w(row(i), a) * self.entering(slot, a, c));
                self.set_u(row(i), c, self.u(row(i), c) - ws);
            }
            for j in 0..=i {
                tile[i][j] = (gamma[i] - gamma[j]).exp() * qk(i, j);
            }
        }
        // O = (exp(gamma) Q) S_0 + P Delta.
        for i in 0..n {
            let t = row(i);
            for c in 0..dv {
                let qs = (0..dk).fold(E::Acc::ZERO, |s, a| s + self.q(t, a) * self.entering(slot, a, c)) * q_inv[i];
                let pd = (0..=i).fold(E::Acc::ZERO, |s, j| s + tile[i][j] * self.u(row(j), c));
                st::<E>(self.b.out, (t * hv + h) * dv + c, gamma[i].exp() * qs + pd);
            }
        }
        // S_n = exp(gamma_n) S_0 + (exp(gamma_n - gamma) K)^T Delta.
        let last = gamma[n - 1];
        for a in 0..dk {
            for c in 0..dv {
                let kd = (0..n).fold(E::Acc::ZERO, |s, j| {
                    s + (last - gamma[j]).exp() * self.k(row(j), a) * k_inv[j] * self.u(row(j), c)
                });
                self.set_s(a, c, last.exp() * self.s(a, c) + kd);
            }
        }
    }
}

impl<E: Elem> GdnOps for GdnTwin<E> {
    fn check_shape(&self, shape: GdnShape) -> Result<()> {
        shape.check()
    }

    fn conv1d_silu(&self, x: u64, w: u64, y: u64, shape: GdnShape, docs: Segments<'_>) -> Result<()> {
        shape.check_docs(docs.ranges)?;
        let (channels, kernel) = (shape.conv_channels(), shape.conv_kernel);
        for doc in docs.ranges {
            for t in doc.clone() {
                let lags = kernel.min(t - doc.start + 1);
                for c in 0..channels {
                    let tap =
                        |lag: usize| ld::<E>(w, c * kernel + kernel - 1 - lag) * ld::<E>(x, (t - lag) * channels + c);
                    st::<E>(y, t * channels + c, silu((0..lags).fold(E::Acc::ZERO, |s, lag| s + tap(lag))));
                }
            }
        }
        Ok(())
    }

    fn gdn_gates(&self, inp: GateInputs, beta: u64, g: u64, shape: GdnShape) -> Result<()> {
        shape.check()?;
        let hv = shape.value_heads;
        for t in 0..shape.tokens {
            for h in 0..hv {
                let i = t * hv + h;
                sta(beta, i, sigmoid(ld::<E>(inp.b, i)));
                let a = ld::<E>(inp.a, i) + ld::<E>(inp.dt_bias, h);
                sta(g, i, -ld::<E>(inp.a_log, h).exp() * softplus(a));
            }
        }
        Ok(())
    }

    fn gated_delta(
        &self,
        b: DeltaBuffers,
        s: DeltaScratch,
        shape: GdnShape,
        docs: Segments<'_>,
        group: Range<usize>,
    ) -> Result<()> {
        shape.check_docs(docs.ranges)?;
        check_group(docs.ranges, &group, shape)?;
        for h in 0..shape.value_heads {
            let head = Head::<E>::new(b, s, shape, h);
            for (slot, c) in chunks(docs.ranges).skip(group.start).take(group.len()).enumerate() {
                head.enter(docs.restarts_at(c.start), slot);
                head.chunk(c.start, c.len(), slot);
            }
        }
        Ok(())
    }

    fn gated_rms_norm(&self, o: u64, z: u64, w: u64, y: u64, shape: GdnShape, eps: f64) -> Result<()> {
        shape.check()?;
        let (dv, eps) = (shape.value_head_dim, E::Acc::from_f64(eps));
        for r in 0..shape.tokens * shape.value_heads {
            let base = r * dv;
            let ss = (0..dv).fold(E::Acc::ZERO, |s, i| s + ld::<E>(o, base + i) * ld::<E>(o, base + i));
            let inv = E::Acc::ONE / (ss / E::Acc::from_f64(dv as f64) + eps).sqrt();
            for i in 0..dv {
                let gate = silu(ld::<E>(z, base + i));
                st::<E>(y, base + i, ld::<E>(o, base + i) * inv * ld::<E>(w, i) * gate);
            }
        }
        Ok(())
    }

    fn partial_rope(&self, x: u64, cos: u64, sin: u64, y: u64, dims: Heads, rotary: usize) -> Result<()> {
        let Heads { tokens, heads, head_dim: d } = dims;
        if !rotary.is_multiple_of(2) || rotary > d {
            return Err(Error::invalid("rotary_dim", format!("{rotary}: must be even and at most head_dim {d}")));
        }
        let half = rotary / 2;
        for row in 0..tokens * heads {
            let (t, base) = (row / heads, row * d);
            // Each pair (i, i + half) is read whole before either is written (in place).
            for i in 0..half {
                let (a, b) = (ld::<E>(x, base + i), ld::<E>(x, base + i + half));
                let (c, s) = (t * rotary + i, t * rotary + i + half);
                st::<E>(y, base + i, a * lda::<E::Acc>(cos, c) - b * lda::<E::Acc>(sin, c));
                st::<E>(y, base + i + half, b * lda::<E::Acc>(cos, s) + a * lda::<E::Acc>(sin, s));
            }
            (rotary..d).for_each(|i| st::<E>(y, base + i, ld::<E>(x, base + i)));
        }
        Ok(())
    }

    fn output_gate(&self, x: u64, gate: u64, y: u64, n: usize) -> Result<()> {
        (0..n).for_each(|i| st::<E>(y, i, ld::<E>(x, i) * sigmoid(ld::<E>(gate, i))));
        Ok(())
    }
}
