//! The CPU twins of the GatedDeltaNet ops (issue 16, `dflash_optimized::ops::gdn::twin`) against
//! the f64 reference of the hybrid target (`dflash_reference::hybrid`, spec section 10): the
//! conv1d and SiLU, the gates, the chunked delta rule and the gated output norm, each on fresh random inputs
//! per case (several seeds and shapes: T below, at and above the chunk of 64, packed documents,
//! value heads sharing key heads), stored as f64, f32 and bf16 and given to the reference as the
//! same stored values in f64; the twin's chunked delta rule against the reference's recurrent form;
//! the twins composed into the reference's whole token mixer; and the gated attention's partial
//! RoPE and sigmoid output gate against `reference::hybrid::layers`.

use std::ops::Range;

use candle_core::{Device, Tensor};
use dflash_conformance::gdn_cases::tiling;
use dflash_conformance::tolerance::{rel_error, Tolerance};
use dflash_optimized::ops::elementwise::Heads;
use dflash_optimized::ops::gdn::twin::GdnTwin;
use dflash_optimized::ops::gdn::{
    groups, one_segment, DeltaBuffers, DeltaScratch, GateInputs, GdnOps, GdnShape, Segments, GDN_CHUNK,
};
use dflash_optimized::ops::Elem;
use dflash_reference::hybrid::config::GdnDims;
use dflash_reference::hybrid::gdn::{
    causal_conv1d, gated_delta_chunked, gated_delta_recurrent, gdn_layer, l2_normalize, repeat_heads, DeltaInputs,
    GdnForm, GdnWeights, DEFAULT_CHUNK, L2_NORM_EPS,
};
use dflash_reference::hybrid::layers::{partial_rope, sigmoid, softplus};
use dflash_reference::ops::{linear, rms_norm, rope_tables, silu};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

/// f64 storage: the twin against the f64 reference.
const GDN_TWIN_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "the same math in f64 in another order (fused loops vs candle ops, the same forward substitution): \
             ~1e-16 per op over sums of at most 64 terms",
};

/// f32 storage: the twin's f32 arithmetic against the f64 reference on the same f32-exact inputs.
const GDN_TWIN_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "the twin's f32 rounding (~6e-8 per op) over dot products of d <= 16, chunk sums of <= 64 terms \
             and the UT inverse's substitution; the f64 reference adds nothing",
};

/// bf16 storage: the same f32 arithmetic, the outputs rounded to bf16.
const GDN_TWIN_BF16: Tolerance = Tolerance {
    rel: 1e-2,
    reason: "outputs stored in bf16 (relative rounding up to 2^-9 ~ 2e-3) over f32 arithmetic; inputs bf16-exact",
};

/// Seeds per shape.
const SEEDS: u64 = 4;

/// `eps` of the gated output norm (the published configs' `rms_norm_eps`).
const NORM_EPS: f64 = 1e-6;

/// One case: sizes, the documents tiling `0..T`, and the seed of its inputs.
struct Case {
    shape: GdnShape,
    docs: Vec<Range<usize>>,
    seed: u64,
}

impl Case {
    /// The reference's flags: true where a document starts.
    fn starts(&self) -> Vec<bool> {
        let mut starts = vec![false; self.shape.tokens];
        self.docs.iter().for_each(|d| starts[d.start] = true);
        starts
    }

    /// The documents as the twins take them (no device table).
    fn segments(&self) -> Segments<'_> {
        Segments { ranges: &self.docs, table: 0, resume: false }
    }

    fn label(&self) -> String {
        let s = &self.shape;
        let (t, hk, hv, dk, dv) = (s.tokens, s.key_heads, s.value_heads, s.key_head_dim, s.value_head_dim);
        format!("T {t}, H_k {hk}, H_v {hv}, d_k {dk}, d_v {dv}, docs {:?}, seed {}", self.docs, self.seed)
    }
}

/// Every case: per shape (T 1, 37, 64, 65, 150 and 200; 1 to 4 value heads per key head), seed 0
/// one document, seed 1 two (the second one, longer than a chunk where T allows, chunked from its
/// own start), the others random documents (each token after the first starts one with
/// probability 1/30).
fn cases() -> Vec<Case> {
    // (T, H_k, H_v, d_k, d_v, K)
    let shapes = [
        (1, 1, 1, 4, 4, 4),
        (37, 1, 2, 8, 4, 4),
        (64, 2, 2, 4, 8, 4),
        (65, 1, 3, 8, 8, 4),
        (150, 2, 4, 16, 8, 4),
        (200, 1, 2, 8, 16, 3),
    ];
    let mut out = Vec::new();
    for (i, &(tokens, key_heads, value_heads, key_head_dim, value_head_dim, conv_kernel)) in shapes.iter().enumerate() {
        let shape = GdnShape { tokens, key_heads, value_heads, key_head_dim, value_head_dim, conv_kernel };
        for s in 0..SEEDS {
            let seed = 1000 * i as u64 + s;
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd0c5);
            let docs = match s {
                0 => tiling(&[tokens]),
                1 if tokens >= 2 => tiling(&[(tokens / 4).max(1), tokens]),
                _ => {
                    let mut ends: Vec<usize> = (1..tokens).filter(|_| rng.random_ratio(1, 30)).collect();
                    ends.push(tokens);
                    tiling(&ends)
                }
            };
            out.push(Case { shape, docs, seed });
        }
    }
    out
}

fn normal(n: usize, gain: f64, rng: &mut ChaCha8Rng) -> Vec<f64> {
    (0..n).map(|_| gain * rng.sample::<f64, _>(StandardNormal)).collect()
}

/// `values` rounded to `E`, and those stored values back in f64 (what the reference is given).
fn stored<E: Elem>(values: &[f64]) -> (Vec<E>, Vec<f64>) {
    let s: Vec<E> = values.iter().map(|&x| E::from_f64(x)).collect();
    let back = s.iter().map(|x| x.to_f64()).collect();
    (s, back)
}

/// As [`stored`], in the arithmetic type of `E`.
fn arithmetic<E: Elem>(values: &[f64]) -> (Vec<E::Acc>, Vec<f64>) {
    use dflash_optimized::ops::Real;
    let s: Vec<E::Acc> = values.iter().map(|&x| E::Acc::from_f64(x)).collect();
    let back = s.iter().map(|x| x.to_f64()).collect();
    (s, back)
}

fn tensor(values: Vec<f64>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(values, shape, &Device::Cpu).expect("tensor")
}

fn addr<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

fn out_addr<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}

/// Values of `E` as an f64 tensor.
fn widened<E: Elem>(v: &[E], shape: &[usize]) -> Tensor {
    tensor(v.iter().map(|x| x.to_f64()).collect(), shape)
}

/// The delta rule's inputs as `reference::hybrid::gdn::gdn_layer` makes them from the conv's
/// output `qkv [T, C]`: q and k heads repeated to the value heads, L2-normed, q scaled.
fn reference_inputs(qkv: &Tensor, beta: Tensor, g: Tensor, shape: GdnShape) -> DeltaInputs {
    let (t, key_dim, dk) = (shape.tokens, shape.key_dim(), shape.key_head_dim);
    let group = shape.value_heads / shape.key_heads;
    let heads = |start: usize, width: usize, d: usize| {
        qkv.narrow(1, start, width).and_then(|x| x.reshape((t, width / d, d))).expect("heads")
    };
    let q = repeat_heads(&heads(0, key_dim, dk), group).expect("repeat q");
    let k = repeat_heads(&heads(key_dim, key_dim, dk), group).expect("repeat k");
    DeltaInputs {
        q: l2_normalize(&q, L2_NORM_EPS).and_then(|q| Ok(q.affine((dk as f64).powf(-0.5), 0.0)?)).expect("q"),
        k: l2_normalize(&k, L2_NORM_EPS).expect("k"),
        v: heads(2 * key_dim, shape.value_dim(), shape.value_head_dim),
        g,
        beta,
    }
}

/// `beta = sigmoid(n)` and `g = -exp(A_log) softplus(n')` as the layer makes them, from standard
/// normal `A_log / 2`, `n` and `n'`: `[T, H_v]` f64 values each.
fn random_gates(shape: GdnShape, rng: &mut ChaCha8Rng) -> (Vec<f64>, Vec<f64>) {
    let (t, hv) = (shape.tokens, shape.value_heads);
    let a_log = normal(hv, 0.5, rng);
    let beta = normal(t * hv, 1.0, rng).into_iter().map(|b| 1.0 / (1.0 + (-b).exp())).collect();
    let g = normal(t * hv, 1.0, rng)
        .into_iter()
        .enumerate()
        .map(|(i, a)| -a_log[i % hv].exp() * (a.max(0.0) + (-a.abs()).exp().ln_1p()))
        .collect();
    (beta, g)
}

/// The twin's delta rule on stored `qkv` and arithmetic `beta`, `g`, its groups of chunks in
/// order (as the forward runs them): `out [T, H_v, d_v]`.
fn twin_delta<E: Elem>(qkv: &[E], beta: &[E::Acc], g: &[E::Acc], case: &Case) -> Vec<E> {
    let shape = case.shape;
    let mut out = vec![E::default(); shape.tokens * shape.value_dim()];
    let d = shape.scratch_values();
    let (mut w, mut states) = (vec![E::default(); d.w], vec![E::default(); d.states]);
    let (mut u, mut carry) = (vec![E::Acc::default(); d.u], vec![E::Acc::default(); d.carry]);
    let b = DeltaBuffers { qkv: addr(qkv), beta: addr(beta), g: addr(g), out: out_addr(&mut out) };
    let s = DeltaScratch {
        w: out_addr(&mut w),
        u: out_addr(&mut u),
        states: out_addr(&mut states),
        carry: out_addr(&mut carry),
    };
    for group in groups(&case.docs, shape) {
        GdnTwin::<E>::default().gated_delta(b, s, shape, case.segments(), group).expect("gated_delta twin");
    }
    out
}

/// The conv1d + SiLU twin's relative error against `silu(causal_conv1d(x, w))`.
fn conv_error<E: Elem>(case: &Case) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let (t, c, k) = (case.shape.tokens, case.shape.conv_channels(), case.shape.conv_kernel);
    let (x, x64) = stored::<E>(&normal(t * c, 1.0, &mut rng));
    let (w, w64) = stored::<E>(&normal(c * k, 0.5, &mut rng));
    let mut y = vec![E::default(); t * c];
    GdnTwin::<E>::default()
        .conv1d_silu(addr(&x), addr(&w), out_addr(&mut y), case.shape, case.segments())
        .expect("conv");
    let want = causal_conv1d(&tensor(x64, &[t, c]), &tensor(w64, &[c, k]), &case.starts()).and_then(|y| silu(&y));
    rel_error(&widened(&y, &[t, c]), &want.expect("reference conv"))
}

/// The gates twin's relative error (the larger of beta's and g's) against the reference's.
fn gates_error<E: Elem>(case: &Case) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let (t, hv) = (case.shape.tokens, case.shape.value_heads);
    let (b, b64) = stored::<E>(&normal(t * hv, 1.0, &mut rng));
    let (a, a64) = stored::<E>(&normal(t * hv, 1.0, &mut rng));
    let (a_log, a_log64) = stored::<E>(&normal(hv, 0.5, &mut rng));
    let (dt_bias, dt_bias64) = stored::<E>(&normal(hv, 0.5, &mut rng));
    let (mut beta, mut g) = (vec![E::Acc::default(); t * hv], vec![E::Acc::default(); t * hv]);
    let inp = GateInputs { b: addr(&b), a: addr(&a), a_log: addr(&a_log), dt_bias: addr(&dt_bias) };
    GdnTwin::<E>::default().gdn_gates(inp, out_addr(&mut beta), out_addr(&mut g), case.shape).expect("gates");
    let want_beta = sigmoid(&tensor(b64, &[t, hv])).expect("sigmoid");
    let want_g = tensor(a64, &[t, hv])
        .broadcast_add(&tensor(dt_bias64, &[hv]))
        .map_err(dflash_reference::Error::from)
        .and_then(|x| softplus(&x))
        .and_then(|x| Ok(x.broadcast_mul(&tensor(a_log64, &[hv]).exp()?.neg()?)?))
        .expect("reference g");
    let acc = |v: &[E::Acc]| {
        use dflash_optimized::ops::Real;
        tensor(v.iter().map(|x| x.to_f64()).collect(), &[t, hv])
    };
    rel_error(&acc(&beta), &want_beta).max(rel_error(&acc(&g), &want_g))
}

/// The delta-rule twin's relative error against the reference's chunked form (chunk 64).
fn delta_error<E: Elem>(case: &Case) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let s = case.shape;
    let (t, c, hv, dv) = (s.tokens, s.conv_channels(), s.value_heads, s.value_head_dim);
    let (qkv, qkv64) = stored::<E>(&normal(t * c, 1.0, &mut rng));
    let (beta, g) = random_gates(s, &mut rng);
    let ((beta, beta64), (g, g64)) = (arithmetic::<E>(&beta), arithmetic::<E>(&g));
    let out = twin_delta(&qkv, &beta, &g, case);
    let inputs = reference_inputs(&tensor(qkv64, &[t, c]), tensor(beta64, &[t, hv]), tensor(g64, &[t, hv]), s);
    let want = gated_delta_chunked(&inputs, &case.starts(), DEFAULT_CHUNK).expect("reference chunked");
    rel_error(&widened(&out, &[t, hv, dv]), &want)
}

/// The gated output norm twin's relative error against `rms_norm(o, w) * silu(z)`.
fn norm_error<E: Elem>(case: &Case) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let (t, hv, dv) = (case.shape.tokens, case.shape.value_heads, case.shape.value_head_dim);
    let (o, o64) = stored::<E>(&normal(t * hv * dv, 1.0, &mut rng));
    let (z, z64) = stored::<E>(&normal(t * hv * dv, 1.0, &mut rng));
    let w_values: Vec<f64> = normal(dv, 0.2, &mut rng).into_iter().map(|x| 1.0 + x).collect();
    let (w, w64) = stored::<E>(&w_values);
    let mut y = vec![E::default(); t * hv * dv];
    let twin = GdnTwin::<E>::default();
    twin.gated_rms_norm(addr(&o), addr(&z), addr(&w), out_addr(&mut y), case.shape, NORM_EPS).expect("norm");
    let shape = [t, hv, dv];
    let want = rms_norm(&tensor(o64, &shape), &tensor(w64, &[dv]), NORM_EPS)
        .and_then(|n| Ok((n * silu(&tensor(z64, &shape))?)?))
        .expect("reference norm");
    rel_error(&widened(&y, &shape), &want)
}

/// One storage of one op: its name, the twin's relative error on a case, the bound.
type Storage = (&'static str, fn(&Case) -> f64, Tolerance);

/// Holds `error` of every case within each storage's tolerance and prints the largest per storage.
fn check_all(op: &str, error: [Storage; 3]) {
    let cases = cases();
    let mut worst = Vec::new();
    for (storage, error, tol) in error {
        let mut max = 0.0f64;
        for case in &cases {
            let err = error(case);
            assert!(
                err <= tol.rel,
                "{op} {storage}, {}: relative error {err:.3e} above {:.0e} ({})",
                case.label(),
                tol.rel,
                tol.reason
            );
            max = max.max(err);
        }
        worst.push(format!("{storage} {max:.2e}"));
    }
    eprintln!("{op} worst over {} cases: {}", cases.len(), worst.join(", "));
}

#[test]
fn conv1d_silu_matches_the_reference() {
    check_all(
        "conv1d_silu",
        [
            ("f64", conv_error::<f64>, GDN_TWIN_F64),
            ("f32", conv_error::<f32>, GDN_TWIN_F32),
            ("bf16", conv_error::<bf16>, GDN_TWIN_BF16),
        ],
    );
}

#[test]
fn gdn_gates_match_the_reference() {
    check_all(
        "gdn_gates",
        [
            ("f64", gates_error::<f64>, GDN_TWIN_F64),
            ("f32", gates_error::<f32>, GDN_TWIN_F32),
            ("bf16", gates_error::<bf16>, GDN_TWIN_BF16),
        ],
    );
}

#[test]
fn gated_delta_matches_the_chunked_reference() {
    check_all(
        "gated_delta",
        [
            ("f64", delta_error::<f64>, GDN_TWIN_F64),
            ("f32", delta_error::<f32>, GDN_TWIN_F32),
            ("bf16", delta_error::<bf16>, GDN_TWIN_BF16),
        ],
    );
}

#[test]
fn gated_rms_norm_matches_the_reference() {
    check_all(
        "gated_rms_norm",
        [
            ("f64", norm_error::<f64>, GDN_TWIN_F64),
            ("f32", norm_error::<f32>, GDN_TWIN_F32),
            ("bf16", norm_error::<bf16>, GDN_TWIN_BF16),
        ],
    );
}

/// The twin's chunked delta rule equals the reference's token-by-token recurrence (the spec's
/// form) in f64 on every case.
#[test]
fn chunked_twin_equals_the_recurrent_reference_in_f64() {
    let mut max = 0.0f64;
    for case in cases() {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
        let s = case.shape;
        let (t, c, hv) = (s.tokens, s.conv_channels(), s.value_heads);
        let qkv = normal(t * c, 1.0, &mut rng);
        let (beta, g) = random_gates(s, &mut rng);
        let out = twin_delta::<f64>(&qkv, &beta, &g, &case);
        let inputs = reference_inputs(&tensor(qkv, &[t, c]), tensor(beta, &[t, hv]), tensor(g, &[t, hv]), s);
        let want = gated_delta_recurrent(&inputs, &case.starts()).expect("reference recurrent");
        let err = rel_error(&tensor(out, &[t, hv, s.value_head_dim]), &want);
        let tol = GDN_TWIN_F64;
        assert!(err <= tol.rel, "{}: relative error {err:.3e} above {:.0e} ({})", case.label(), tol.rel, tol.reason);
        max = max.max(err);
    }
    eprintln!("chunked twin vs recurrent reference worst (f64): {max:.2e}");
}

/// Decoding's split: a document run as its first `m` tokens, then the rest as one segment
/// resuming the carried state (`Segments::resume`), gives the one-launch output and final state
/// in f64, for every split point of the one-document cases.
#[test]
fn a_resumed_launch_continues_the_carried_state() {
    let twin = GdnTwin::<f64>::default();
    let mut max = 0.0f64;
    for case in cases().into_iter().filter(|c| c.docs.len() == 1 && c.shape.tokens >= 2) {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
        let s = case.shape;
        let (t, c, hv, vd) = (s.tokens, s.conv_channels(), s.value_heads, s.value_dim());
        let qkv = normal(t * c, 1.0, &mut rng);
        let (beta, g) = random_gates(s, &mut rng);
        let d = s.scratch_values();
        // The whole document in one launch: its output and the state it leaves in the carry.
        let run = |from: usize, to: usize, resume: bool, carry: &mut Vec<f64>, out: &mut [f64]| {
            let shape = GdnShape { tokens: to - from, ..s };
            let one = one_segment(to - from);
            let (mut w, mut u, mut states) = (vec![0.0; d.w], vec![0.0; d.u], vec![0.0; d.states]);
            let b = DeltaBuffers {
                qkv: addr(&qkv[from * c..]),
                beta: addr(&beta[from * hv..]),
                g: addr(&g[from * hv..]),
                out: out_addr(&mut out[from * vd..]),
            };
            let scratch = DeltaScratch {
                w: out_addr(&mut w),
                u: out_addr(&mut u),
                states: out_addr(&mut states),
                carry: out_addr(carry),
            };
            for group in groups(&one, shape) {
                let docs = Segments { ranges: &one, table: 0, resume };
                twin.gated_delta(b, scratch, shape, docs, group).expect("gated_delta twin");
            }
        };
        let (mut whole, mut whole_state) = (vec![0.0; t * vd], vec![0.0; d.carry]);
        run(0, t, false, &mut whole_state, &mut whole);
        for m in [1, t / 2, t - 1].into_iter().filter(|&m| m >= 1 && m < t) {
            let (mut split, mut state) = (vec![0.0; t * vd], vec![f64::NAN; d.carry]);
            run(0, m, false, &mut state, &mut split);
            run(m, t, true, &mut state, &mut split);
            let err = rel_error(&tensor(split, &[t, vd]), &tensor(whole.clone(), &[t, vd]))
                .max(rel_error(&tensor(state, &[d.carry]), &tensor(whole_state.clone(), &[d.carry])));
            let tol = GDN_TWIN_F64;
            assert!(err <= tol.rel, "{} split at {m}: {err:.3e} above {:.0e} ({})", case.label(), tol.rel, tol.reason);
            max = max.max(err);
        }
    }
    eprintln!("resumed launches vs one launch worst (f64): {max:.2e}");
}

/// The four twins with the reference's projections in between give the reference's whole
/// GatedDeltaNet token mixer (`gdn_layer`, chunked) on a packed row, in f64: the twins read the
/// layer's layouts (q, k, v channels of the conv, head order, the conv taps of `[C, 1, K]`).
#[test]
fn twins_compose_to_the_reference_token_mixer() {
    let dims = GdnDims { conv_kernel: 4, num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 16 };
    let (hidden, t) = (32, 150);
    let case = Case { shape: GdnShape::new(&dims, t), docs: tiling(&[20, 100, 101, t]), seed: 7 };
    let s = case.shape;
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let mut weight = |shape: &[usize], gain: f64| tensor(normal(shape.iter().product(), gain, &mut rng), shape);
    let proj = (hidden as f64).powf(-0.5);
    let (c, hv, dv, vd) = (s.conv_channels(), s.value_heads, s.value_head_dim, s.value_dim());
    let x = weight(&[t, hidden], 1.0);
    let (qkv_w, z_w, b_w, a_w) = (
        weight(&[c, hidden], proj),
        weight(&[vd, hidden], proj),
        weight(&[hv, hidden], 1.0),
        weight(&[hv, hidden], 1.0),
    );
    let (conv, a_log, dt_bias) = (weight(&[c, 1, dims.conv_kernel], 0.5), weight(&[hv], 0.5), weight(&[hv], 0.5));
    let norm = weight(&[dv], 0.2).affine(1.0, 1.0).expect("norm weight");
    let out_proj = weight(&[hidden, vd], (vd as f64).powf(-0.5));
    let w = GdnWeights {
        in_proj_qkv: &qkv_w,
        in_proj_z: &z_w,
        in_proj_b: &b_w,
        in_proj_a: &a_w,
        conv1d: &conv,
        a_log: &a_log,
        dt_bias: &dt_bias,
        norm: &norm,
        out_proj: &out_proj,
    };
    let want = gdn_layer(&x, &w, &dims, NORM_EPS, &case.starts(), GdnForm::Chunked { chunk: GDN_CHUNK })
        .expect("reference layer");

    let values = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("values");
    let project = |w: &Tensor| values(&linear(&x, w).expect("projection"));
    let twin = GdnTwin::<f64>::default();
    let (qkv_pre, conv_taps) = (project(&qkv_w), values(&conv));
    let mut qkv = vec![0.0; t * c];
    twin.conv1d_silu(addr(&qkv_pre), addr(&conv_taps), out_addr(&mut qkv), s, case.segments()).expect("conv");
    let (b, a, a_log, dt_bias) = (project(&b_w), project(&a_w), values(&a_log), values(&dt_bias));
    let (mut beta, mut g) = (vec![0.0; t * hv], vec![0.0; t * hv]);
    let gates = GateInputs { b: addr(&b), a: addr(&a), a_log: addr(&a_log), dt_bias: addr(&dt_bias) };
    twin.gdn_gates(gates, out_addr(&mut beta), out_addr(&mut g), s).expect("gates");
    let mut o = twin_delta::<f64>(&qkv, &beta, &g, &case);
    let (z, norm) = (project(&z_w), values(&norm));
    let o_addr = out_addr(&mut o);
    twin.gated_rms_norm(o_addr, addr(&z), addr(&norm), o_addr, s, NORM_EPS).expect("norm in place");
    let got = linear(&tensor(o, &[t, vd]), &out_proj).expect("out_proj");
    let err = rel_error(&got, &want);
    eprintln!("twins composed vs gdn_layer (f64): {err:.2e}");
    let tol = GDN_TWIN_F64;
    assert!(err <= tol.rel, "relative error {err:.3e} above {:.0e} ({})", tol.rel, tol.reason);
}

/// Shapes and documents the ops cannot run on are refused, naming what is wrong.
#[test]
fn bad_shapes_and_documents_are_refused() {
    let shape =
        GdnShape { tokens: 10, key_heads: 2, value_heads: 4, key_head_dim: 4, value_head_dim: 4, conv_kernel: 4 };
    assert!(shape.check_docs(&tiling(&[3, 10])).is_ok());
    for docs in [
        vec![],
        vec![0..3, 4..10],
        vec![0..3, 2..10],
        vec![0..10, 10..10],
        tiling(&[9]),
        vec![Range { start: 1, end: 10 }],
    ] {
        let err = shape.check_docs(&docs).expect_err("bad documents").to_string();
        assert!(err.contains("docs") && err.contains("do not tile 0..10"), "{docs:?}: {err}");
    }
    let err = GdnShape { value_heads: 3, ..shape }.check().expect_err("3 of 2").to_string();
    assert!(err.contains("3 value heads are not a multiple of 2 key heads"), "{err}");
    let err = GdnShape { key_head_dim: 0, ..shape }.check().expect_err("empty").to_string();
    assert!(err.contains("empty size"), "{err}");
    let twin = GdnTwin::<f64>::default();
    let short = tiling(&[5]);
    let err = twin
        .conv1d_silu(0, 0, 0, shape, Segments { ranges: &short, table: 0, resume: false })
        .expect_err("short")
        .to_string();
    assert!(err.contains("do not tile"), "{err}");
    // Chunk groups: empty, beyond the chunks, or longer than the state slots.
    let docs = tiling(&[3, 10]);
    let b = DeltaBuffers { qkv: 0, beta: 0, g: 0, out: 0 };
    let s = DeltaScratch { w: 0, u: 0, states: 0, carry: 0 };
    for group in [0..0, 1..3, 0..2] {
        let err = twin.gated_delta(b, s, shape, Segments { ranges: &docs, table: 0, resume: false }, group.clone());
        let err = err.expect_err("bad group").to_string();
        assert!(err.contains("within the 2 chunks and at most 1 long"), "{group:?}: {err}");
    }
}

/// The partial RoPE twin's relative error against `layers::partial_rope` on `[T, heads, d]` with
/// RoPE on the first `rotary` dims, positions restarting (two documents), in place.
fn partial_rope_error<E: Elem>((t, heads, d, rotary): (usize, usize, usize, usize), seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut x, x64) = stored::<E>(&normal(t * heads * d, 1.0, &mut rng));
    let positions: Vec<usize> = (0..t).map(|i| if i < t / 3 { i } else { i - t / 3 }).collect();
    let (cos, sin) = rope_tables(&positions, rotary, 1e4, candle_core::DType::F64).expect("tables");
    let values = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f64>()).expect("values");
    let ((cos_a, _), (sin_a, _)) = (arithmetic::<E>(&values(&cos)), arithmetic::<E>(&values(&sin)));
    let x_addr = out_addr(&mut x);
    let dims = Heads { tokens: t, heads, head_dim: d };
    GdnTwin::<E>::default().partial_rope(x_addr, addr(&cos_a), addr(&sin_a), x_addr, dims, rotary).expect("rope");
    let want = partial_rope(&tensor(x64, &[t, heads, d]), &cos, &sin).expect("reference rope");
    rel_error(&widened(&x, &[t, heads, d]), &want)
}

/// The output gate twin's relative error against `x * sigmoid(gate)`, in place.
fn output_gate_error<E: Elem>(n: usize, seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut x, x64) = stored::<E>(&normal(n, 1.0, &mut rng));
    let (gate, gate64) = stored::<E>(&normal(n, 2.0, &mut rng));
    let x_addr = out_addr(&mut x);
    GdnTwin::<E>::default().output_gate(x_addr, addr(&gate), x_addr, n).expect("gate");
    let want = sigmoid(&tensor(gate64, &[n])).and_then(|g| Ok((tensor(x64, &[n]) * g)?)).expect("reference gate");
    rel_error(&widened(&x, &[n]), &want)
}

/// Partial RoPE (a quarter, a half and all of the head rotated, the tail copied) and the output
/// gate, stored as f64, f32 and bf16, against the reference; an odd or too wide rotary part is
/// refused.
#[test]
fn partial_rope_and_output_gate_match_the_reference() {
    let storages = [GDN_TWIN_F64, GDN_TWIN_F32, GDN_TWIN_BF16];
    let mut worst = [0.0f64; 3];
    for (seed, shape) in [(5, 2, 16, 4), (37, 3, 32, 16), (9, 1, 8, 8), (70, 2, 64, 16)].into_iter().enumerate() {
        let seed = seed as u64;
        let rope = [partial_rope_error::<f64>, partial_rope_error::<f32>, partial_rope_error::<bf16>];
        let gate = [output_gate_error::<f64>, output_gate_error::<f32>, output_gate_error::<bf16>];
        for (s, tol) in storages.iter().enumerate() {
            let n = shape.0 * shape.1 * shape.2;
            for (op, err) in [("partial_rope", rope[s](shape, seed)), ("output_gate", gate[s](n, seed))] {
                assert!(err <= tol.rel, "{op} {shape:?} storage {s}: {err:.3e} above {:.0e} ({})", tol.rel, tol.reason);
                worst[s] = worst[s].max(err);
            }
        }
    }
    eprintln!("partial_rope and output_gate worst: f64 {:.2e}, f32 {:.2e}, bf16 {:.2e}", worst[0], worst[1], worst[2]);
    let twin = GdnTwin::<f64>::default();
    for rotary in [3, 10] {
        let err = twin.partial_rope(0, 0, 0, 0, Heads { tokens: 1, heads: 1, head_dim: 8 }, rotary).expect_err("bad");
        assert!(err.to_string().contains("must be even and at most head_dim 8"), "{err}");
    }
}
