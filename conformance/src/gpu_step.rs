//! Checks of the planned training step: every `step.cu` kernel against its CPU twin on fresh
//! random inputs, and the whole step under every checkpointing policy against the reference in
//! f64, with its measured memory peak against the plan. `xtask gpu-conformance` runs them on the
//! H200 (CI has no GPU; the attestation records the results); `tests/host_step.rs` runs the step
//! checks on the CPU backend in CI, its heap measured by a counting allocator.

use candle_core::{DType, Device, Tensor, Var};
pub use dflash_optimized::attention::cases::rel_error;
use dflash_optimized::gpu::Gpu;
use dflash_optimized::planner::{Policy, StepShape};
use dflash_optimized::step::lm_head_ce::ce_grad_rows;
use dflash_optimized::step::ops;
use dflash_optimized::step::planned::backend::{Backend, Cuda, Elem};
use dflash_optimized::step::planned::device::Buf;
use dflash_optimized::step::planned::kernels::{normal_at, AdamWArgs, StepKernels, StepOps, GRAD_PARTS};
use dflash_optimized::step::planned::step::Step;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{DraftInput, Drafter, FrozenHead};
use dflash_reference::loss::{decayed_ce, BlockTargets};
use dflash_reference::optim::{AdamW, AdamWConfig};
use dflash_reference::Result;
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::setups::{gpu_draft_case, DraftCase};
use crate::tolerance::{Tolerance, GPU_KERNEL_BF16, GPU_STEP_BF16, STEP_F32};

/// Gradients of the same step under two checkpointing policies.
pub const POLICIES_AGREE: Tolerance = Tolerance {
    rel: 1e-6,
    reason: "a recompute repeats the same kernels and cuBLAS calls on the same inputs: identical up to \
             cuBLAS picking another algorithm for a shape (fp32 accumulation order, ~1e-7)",
};

/// How far below the plan the measured peak may be (issue 4: the plan within 15% of it).
pub const PLAN_SLACK: f64 = 0.15;

/// One GPU check: named relative errors under one tolerance, and for a step its measured and
/// planned memory.
#[derive(Clone, Debug)]
pub struct GpuCheck {
    pub name: String,
    pub errors: Vec<(String, f64)>,
    pub tolerance: f64,
    /// `(measured pool peak, planned bytes)` of a step.
    pub memory: Option<(u64, u64)>,
}

impl GpuCheck {
    pub fn worst(&self) -> f64 {
        self.errors.iter().map(|e| e.1).fold(0.0, f64::max)
    }

    /// Every error within the tolerance (NaN fails), and a measured peak neither above the plan
    /// nor more than [`PLAN_SLACK`] below it.
    pub fn pass(&self) -> bool {
        let errors_ok = self.errors.iter().all(|(_, e)| *e <= self.tolerance);
        let memory_ok = self.memory.is_none_or(|(measured, planned)| {
            measured <= planned && measured as f64 >= planned as f64 * (1.0 - PLAN_SLACK)
        });
        errors_ok && memory_ok
    }
}

fn flat(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Measures the memory peak of a backend: the GPU's pool high-water mark, or (on the CPU) a
/// counting allocator.
pub trait PeakMeter {
    /// Starts a measurement from the memory in use now.
    fn start(&mut self) -> Result<()>;
    /// Forgets the peak so far, keeping the start (the next peak counts from what is in use now).
    fn forget_peak(&mut self) -> Result<()>;
    /// The highest use since the start (or the last forget), minus the use at the start.
    fn peak(&mut self) -> Result<u64>;
}

/// The GPU memory pool's high-water mark.
pub struct PoolMeter<'a> {
    pub gpu: &'a Gpu,
    before: u64,
}

impl<'a> PoolMeter<'a> {
    pub fn new(gpu: &'a Gpu) -> Self {
        PoolMeter { gpu, before: 0 }
    }
}

impl PeakMeter for PoolMeter<'_> {
    fn start(&mut self) -> Result<()> {
        self.before = self.gpu.pool_used()?;
        self.gpu.reset_pool_high()
    }

    fn forget_peak(&mut self) -> Result<()> {
        self.gpu.reset_pool_high()
    }

    fn peak(&mut self) -> Result<u64> {
        Ok(self.gpu.pool_used_high()?.saturating_sub(self.before))
    }
}

/// The GPU step of the random case `seed` under every policy against the reference in f64:
/// see [`planned_step_checks`].
pub fn step_checks(gpu: &Gpu, seed: u64) -> Result<Vec<GpuCheck>> {
    planned_step_checks(seed, "step", || Cuda::new(gpu, 64), &mut PoolMeter::new(gpu), 0)
}

/// The planned step on the backends `backend()` makes, for the random case `seed` under every
/// policy, against the reference in f64 (the bf16 step's bound for bf16 storage, the f32 step's
/// for f32): the loss, every parameter gradient (the worst named),
/// the policies against each other, and each policy's memory peak (measured by `meter` from
/// before the step's buffers exist, through one step) against its plan plus `allowance` bytes.
pub fn planned_step_checks<B: Backend>(
    seed: u64,
    label: &str,
    backend: impl Fn() -> Result<B>,
    meter: &mut dyn PeakMeter,
    allowance: u64,
) -> Result<Vec<GpuCheck>> {
    // The inputs the step stores, exactly: only its own arithmetic is measured.
    let (storage, tolerance) = if B::Elem::BYTES == 2 { (DType::BF16, GPU_STEP_BF16) } else { (DType::F32, STEP_F32) };
    let case = rounded_to(gpu_draft_case(seed, DType::F64)?, storage)?;
    let config = &case.drafter.config;
    let b = config.block_size;
    let input = DraftInput::training(&case.row, &case.anchors, b)?;
    let targets = BlockTargets::new(&case.row.tokens, &case.row.loss_mask, &case.anchors, b, case.gamma);
    let logits = case.drafter.forward(&case.head, &input)?;
    let loss = decayed_ce(&logits, &targets)?;
    let reference_grads = loss.backward()?;
    let reference_loss = loss.to_scalar::<f64>()?;
    let want: Vec<Vec<f64>> = case
        .drafter
        .named_params()
        .iter()
        .map(|(_, var)| match reference_grads.get(var.as_tensor()) {
            Some(g) => flat(g),
            None => Ok(vec![0.0; var.elem_count()]),
        })
        .collect::<Result<_>>()?;

    let rows = input.layout.num_queries();
    let shape = StepShape {
        context_len: case.row.len(),
        num_anchors: case.anchors.positions.len(),
        lm_chunk_rows: ChaCha8Rng::seed_from_u64(seed).random_range(1..=rows),
    };
    let c = &config.dims;
    let describe = format!(
        "S={} N={} B={b} H={} I={} heads {}/{} V={} window {:?}",
        shape.context_len,
        shape.num_anchors,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.vocab_size,
        c.layer_kinds[0]
    );
    let total = targets.total_weight();
    let mut checks = Vec::new();
    let mut per_policy: Vec<Vec<Vec<f64>>> = Vec::new();
    for policy in Policy::ALL {
        let dev = backend()?;
        meter.start()?;
        let mut step = Step::with_backend(dev, config, shape, policy, false)?;
        step.load_weights(&case.drafter)?;
        step.load_lm_head(&case.head)?;
        step.set_input(&input, &case.head, &targets)?;
        // Staging the input on the host is not the step's memory: count from here on.
        meter.forget_peak()?;
        let got_loss = step.step(if total > 0.0 { 1.0 / total } else { 0.0 })?;
        step.grad_sum_squares("grads")?;
        let measured = meter.peak()?;
        let planned = step.planned_peak() + allowance;
        let got: Vec<Vec<f64>> =
            step.grads_to_host()?.into_iter().map(|(_, g)| g.into_iter().map(f64::from).collect()).collect();
        let mut errors = vec![("loss".to_string(), rel_error(&[got_loss.loss], &[reference_loss]))];
        let (worst_name, worst) = case
            .drafter
            .named_params()
            .iter()
            .zip(got.iter().zip(&want))
            .map(|((name, _), (g, w))| (name.clone(), rel_error(g, w)))
            .fold((String::new(), -1.0), |a, b| if b.1 > a.1 { b } else { a });
        errors.push((format!("worst gradient ({worst_name})"), worst));
        checks.push(GpuCheck {
            name: format!("{label} seed {seed} {} [{describe}]", policy.name()),
            errors,
            tolerance: tolerance.rel,
            memory: Some((measured, planned)),
        });
        per_policy.push(got);
    }
    let mut agree = Vec::new();
    for (p, other) in Policy::ALL.iter().zip(&per_policy).skip(1) {
        let worst = other.iter().zip(&per_policy[0]).map(|(a, b)| rel_error(a, b)).fold(0.0, f64::max);
        agree.push((format!("{} vs none", p.name()), worst));
    }
    checks.push(GpuCheck {
        name: format!("{label} seed {seed} policies agree"),
        errors: agree,
        tolerance: POLICIES_AGREE.rel,
        memory: None,
    });
    Ok(checks)
}

/// `case` with every weight, frozen table and feature rounded to `storage` (kept in f64): the
/// step computes on exactly these values, so the reference sees the same inputs and only the
/// step's own arithmetic is measured.
fn rounded_to(case: DraftCase, storage: DType) -> Result<DraftCase> {
    let round = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(storage)?.to_dtype(DType::F64)?) };
    let drafter = Drafter::from_fn(case.drafter.config.clone(), |name, _| round(case.drafter.param(name)))?;
    let head = FrozenHead { embed: round(&case.head.embed)?, lm_head: round(&case.head.lm_head)? };
    let row = TrainRow { features: round(&case.row.features)?, ..case.row };
    Ok(DraftCase { drafter, head, row, ..case })
}

/// Random bf16 values (normal, scaled by `std`, shifted by `mean`) and their exact f64 values.
fn draw(n: usize, mean: f64, std: f64, rng: &mut ChaCha8Rng) -> (Vec<bf16>, Vec<f64>) {
    use rand_distr::{Distribution, StandardNormal};
    let v: Vec<bf16> = (0..n)
        .map(|_| {
            let z: f64 = StandardNormal.sample(rng);
            bf16::from_f64(mean + std * z)
        })
        .collect();
    let exact = v.iter().map(|x| x.to_f64()).collect();
    (v, exact)
}

fn widen_bf16(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn widen_f32(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn tensor(v: &[f64], shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)?)
}

/// Every `step.cu` kernel against its CPU twin on fresh random inputs from `seed`.
pub fn kernel_checks(gpu: &Gpu, seed: u64) -> Result<Vec<GpuCheck>> {
    let k = StepKernels::load(gpu)?;
    let stream = gpu.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut checks = Vec::new();
    let mut check = |name: &str, errors: Vec<(&str, f64)>, tol: Tolerance| {
        checks.push(GpuCheck {
            name: format!("kernel {name}"),
            errors: errors.into_iter().map(|(n, e)| (n.to_string(), e)).collect(),
            tolerance: tol.rel,
            memory: None,
        })
    };
    let bf = |v: &[bf16]| Buf::from_host(stream, "input", v);
    let f32s = |v: &[f64]| Buf::from_host(stream, "input", &v.iter().map(|&x| x as f32).collect::<Vec<_>>());
    let eps = 1e-6;

    // RMSNorm forward and backward (with the residual gradient and dw accumulation).
    let (rows, n) = (rng.random_range(1..=70), 64 * rng.random_range(1..=80));
    let (x, xf) = draw(rows * n, 0.0, 1.5, &mut rng);
    let (w, wf) = draw(n, 1.0, 0.3, &mut rng);
    let (dy, dyf) = draw(rows * n, 0.0, 1.0, &mut rng);
    let (dres, dresf) = draw(rows * n, 0.0, 1.0, &mut rng);
    let (y_dev, inv_dev) = (Buf::<bf16>::zeros(stream, "y", rows * n)?, Buf::<f32>::zeros(stream, "inv", rows)?);
    let (xb, wb) = (bf(&x)?, bf(&w)?);
    k.rms_norm_forward(xb.ptr(), wb.ptr(), y_dev.ptr(), inv_dev.ptr(), rows, n, eps as f32)?;
    let (y_want, inv_want) = ops::rms_norm_forward(&tensor(&xf, &[rows, n])?, &tensor(&wf, &[n])?, eps)?;
    check(
        &format!("rms_norm_forward [{rows}, {n}]"),
        vec![
            ("y", rel_error(&widen_bf16(&y_dev.download(stream)?), &flat(&y_want)?)),
            ("inv", rel_error(&widen_f32(&inv_dev.download(stream)?), &flat(&inv_want)?)),
        ],
        GPU_KERNEL_BF16,
    );
    let inv_f = flat(&inv_want)?;
    let dw = Buf::<bf16>::zeros(stream, "dw", n)?;
    let (dyb, resb, invb) = (bf(&dy)?, bf(&dres)?, f32s(&inv_f)?);
    let dx = Buf::<bf16>::zeros(stream, "dx", rows * n)?;
    let partial = Buf::<f32>::zeros(stream, "partial", GRAD_PARTS * n)?;
    k.rms_norm_backward(
        (dyb.ptr(), xb.ptr(), wb.ptr(), invb.ptr(), resb.ptr()),
        dx.ptr(),
        dw.ptr(),
        partial.ptr(),
        rows,
        n,
    )?;
    let (dx_want, dw_want) = ops::rms_norm_backward(
        &tensor(&dyf, &[rows, n])?,
        &tensor(&xf, &[rows, n])?,
        &tensor(&wf, &[n])?,
        &tensor(&inv_f, &[rows, 1])?,
    )?;
    let dx_want: Vec<f64> = flat(&dx_want)?.iter().zip(&dresf).map(|(a, b)| a + b).collect();
    let dw_want = flat(&dw_want)?;
    check(
        &format!("rms_norm_backward [{rows}, {n}]"),
        vec![
            ("dx", rel_error(&widen_bf16(&dx.download(stream)?), &dx_want)),
            ("dw", rel_error(&widen_bf16(&dw.download(stream)?), &dw_want)),
        ],
        GPU_KERNEL_BF16,
    );

    // Head norm + RoPE forward and backward.
    let (t, heads, d) = (rng.random_range(1..=90), rng.random_range(1..=5), 64 * rng.random_range(1..=4));
    let positions: Vec<usize> = (0..t).map(|_| rng.random_range(0..5000)).collect();
    let (cos, sin) = dflash_reference::ops::rope_tables(&positions, d, 1e6, DType::F64)?;
    let (cosf, sinf) = (flat(&cos)?, flat(&sin)?);
    let (hx, hxf) = draw(t * heads * d, 0.0, 2.0, &mut rng);
    let (hw, hwf) = draw(d, 1.0, 0.3, &mut rng);
    let (hxb, hwb, cb, sb) = (bf(&hx)?, bf(&hw)?, f32s(&cosf)?, f32s(&sinf)?);
    let hy = Buf::<bf16>::zeros(stream, "y", t * heads * d)?;
    let hinv = Buf::<f32>::zeros(stream, "inv", t * heads)?;
    k.head_norm_rope_forward(
        (hxb.ptr(), hwb.ptr(), cb.ptr(), sb.ptr()),
        hy.ptr(),
        hinv.ptr(),
        (t, heads, d),
        eps as f32,
    )?;
    let hx_t = tensor(&hxf, &[t, heads, d])?;
    let (normed, hinv_want) = ops::rms_norm_forward(&hx_t, &tensor(&hwf, &[d])?, eps)?;
    let hy_want = ops::rope_forward(&normed, &cos, &sin)?;
    check(
        &format!("head_norm_rope_forward [{t}, {heads}, {d}]"),
        vec![
            ("y", rel_error(&widen_bf16(&hy.download(stream)?), &flat(&hy_want)?)),
            ("inv", rel_error(&widen_f32(&hinv.download(stream)?), &flat(&hinv_want)?)),
        ],
        GPU_KERNEL_BF16,
    );
    let (hdy, hdyf) = draw(t * heads * d, 0.0, 1.0, &mut rng);
    let hinv_f = flat(&hinv_want)?;
    let (hdyb, hinvb) = (bf(&hdy)?, f32s(&hinv_f)?);
    let hdw = Buf::<bf16>::zeros(stream, "dw", d)?;
    let hdx = Buf::<bf16>::zeros(stream, "dx", t * heads * d)?;
    let hpartial = Buf::<f32>::zeros(stream, "partial", GRAD_PARTS * d)?;
    k.head_norm_rope_backward(
        (hdyb.ptr(), hxb.ptr(), hwb.ptr(), hinvb.ptr(), cb.ptr(), sb.ptr()),
        hdx.ptr(),
        hdw.ptr(),
        hpartial.ptr(),
        (t, heads, d),
    )?;
    let dnormed = ops::rope_backward(&tensor(&hdyf, &[t, heads, d])?, &cos, &sin)?;
    let (hdx_want, hdw_want) =
        ops::rms_norm_backward(&dnormed, &hx_t, &tensor(&hwf, &[d])?, &tensor(&hinv_f, &[t, heads, 1])?)?;
    let hdw_want = flat(&hdw_want)?;
    check(
        &format!("head_norm_rope_backward [{t}, {heads}, {d}]"),
        vec![
            ("dx", rel_error(&widen_bf16(&hdx.download(stream)?), &flat(&hdx_want)?)),
            ("dw", rel_error(&widen_bf16(&hdw.download(stream)?), &hdw_want)),
        ],
        GPU_KERNEL_BF16,
    );

    // SwiGLU forward and backward over [gate | up] rows, in place as the step runs it; an
    // intermediate size of a multiple of 8 (16-byte loads) and one of another size.
    let inter8 = 8 * rng.random_range(1..=200);
    for inter in [inter8, inter8 + rng.random_range(1..8)] {
        let rows = rng.random_range(1..=90);
        let m = rows * inter;
        let (g, gf) = draw(m, 0.0, 2.0, &mut rng);
        let (u, uf) = draw(m, 0.0, 1.0, &mut rng);
        let (dh, dhf) = draw(m, 0.0, 1.0, &mut rng);
        let gate_up: Vec<bf16> =
            (0..rows).flat_map(|r| [&g[r * inter..][..inter], &u[r * inter..][..inter]].concat()).collect();
        let (gub, dhb) = (bf(&gate_up)?, bf(&dh)?);
        let h = Buf::<bf16>::zeros(stream, "h", m)?;
        k.swiglu_forward(gub.ptr(), h.ptr(), rows, inter)?;
        let (gt, ut) = (tensor(&gf, &[rows, inter])?, tensor(&uf, &[rows, inter])?);
        let h_want = ops::swiglu_forward(&gt, &ut)?;
        let h_got = widen_bf16(&h.download(stream)?);
        k.swiglu_backward(dhb.ptr(), gub.ptr(), rows, inter)?;
        let (dg_want, du_want) = ops::swiglu_backward(&tensor(&dhf, &[rows, inter])?, &gt, &ut)?;
        let got = widen_bf16(&gub.download(stream)?);
        let (dg_got, du_got): (Vec<f64>, Vec<f64>) = (
            (0..rows).flat_map(|r| got[r * 2 * inter..][..inter].to_vec()).collect(),
            (0..rows).flat_map(|r| got[r * 2 * inter + inter..][..inter].to_vec()).collect(),
        );
        check(
            &format!("swiglu forward/backward [{rows}, 2 x {inter}]"),
            vec![
                ("h", rel_error(&h_got, &flat(&h_want)?)),
                ("dgate", rel_error(&dg_got, &flat(&dg_want)?)),
                ("dup", rel_error(&du_got, &flat(&du_want)?)),
            ],
            GPU_KERNEL_BF16,
        );
    }

    // CE gradient rows: in place over bf16 logits; a vocab of a multiple of 8 (16-byte loads)
    // and one of another size (one logit at a time).
    let vocab8 = 8 * rng.random_range(1..=20_000);
    for vocab in [vocab8, vocab8 + rng.random_range(1..8)] {
        let ce_rows = rng.random_range(1..=9);
        let (z, zf) = draw(ce_rows * vocab, 0.0, 3.0, &mut rng);
        let labels: Vec<u32> = (0..ce_rows).map(|_| rng.random_range(0..vocab as u32)).collect();
        let weights: Vec<f64> = (0..ce_rows).map(|_| rng.random_range(0.1..1.0)).collect();
        let scale = rng.random_range(0.01..1.0);
        let zb = bf(&z)?;
        let (lb, wb2) = (Buf::from_host(stream, "labels", &labels)?, f32s(&weights)?);
        let loss = Buf::<f32>::zeros(stream, "loss", ce_rows)?;
        k.ce_grad_rows(zb.ptr(), lb.ptr(), wb2.ptr(), loss.ptr(), ce_rows, vocab, scale as f32)?;
        // The twin on weights that already carry the scale; its CE sum is then scaled too.
        let scaled = weights.iter().map(|&w| f64::from(w as f32) * f64::from(scale as f32)).collect();
        let targets = BlockTargets { labels: labels.clone(), weights: scaled };
        let row_ids: Vec<u32> = (0..ce_rows as u32).collect();
        let mut dz_want = zf.clone();
        let ce_sum = ce_grad_rows(&mut dz_want, &row_ids, &targets) / f64::from(scale as f32);
        let loss_got: f64 = widen_f32(&loss.download(stream)?).iter().sum();
        check(
            &format!("ce_grad_rows [{ce_rows}, {vocab}]"),
            vec![
                ("dz", rel_error(&widen_bf16(&zb.download(stream)?), &dz_want)),
                ("loss", rel_error(&[loss_got], &[ce_sum])),
            ],
            GPU_KERNEL_BF16,
        );
    }

    // AdamW: two updates from zero moments against the reference optimizer.
    let pn = rng.random_range(1..=50_000);
    let (_, p0) = draw(pn, 0.0, 1.0, &mut rng);
    let p0: Vec<f64> = p0.iter().map(|&x| f64::from(x as f32)).collect();
    let grads: Vec<Vec<f64>> =
        (0..2).map(|_| draw(pn, 0.0, 1.0, &mut rng).1.iter().map(|&x| f64::from(x as f32)).collect()).collect();
    let config = AdamWConfig { lr: 1e-2, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 };
    let var = Var::from_tensor(&tensor(&p0, &[pn])?)?;
    let params = vec![("p".to_string(), var.clone())];
    let mut reference = AdamW::new(&params, config.clone())?;
    let (pb, mb, vb) = (f32s(&p0)?, Buf::<f32>::zeros(stream, "m", pn)?, Buf::<f32>::zeros(stream, "v", pn)?);
    let p16 = Buf::<bf16>::zeros(stream, "p_bf16", pn)?;
    let grad_scale = 0.5;
    for (t, g) in grads.iter().enumerate() {
        let scaled: Vec<f64> = g.iter().map(|x| x * grad_scale).collect();
        reference.step(&params, &[tensor(&scaled, &[pn])?], config.lr)?;
        let gb = f32s(g)?;
        let step = t as i32 + 1;
        let args = AdamWArgs {
            lr: config.lr as f32,
            beta1: config.beta1 as f32,
            beta2: config.beta2 as f32,
            eps: config.eps as f32,
            weight_decay: config.weight_decay as f32,
            bc1: (1.0 - config.beta1.powi(step)) as f32,
            bc2: (1.0 - config.beta2.powi(step)) as f32,
            grad_scale: grad_scale as f32,
        };
        k.adamw_update((pb.ptr(), gb.ptr(), mb.ptr(), vb.ptr(), p16.ptr()), pn, args)?;
    }
    let p_want = flat(var.as_tensor())?;
    let update: Vec<f64> = p_want.iter().zip(&p0).map(|(a, b)| a - b).collect();
    let p_got = widen_f32(&pb.download(stream)?);
    let update_got: Vec<f64> = p_got.iter().zip(&p0).map(|(a, b)| a - b).collect();
    check(
        &format!("adamw_update x2 [{pn}]"),
        vec![
            ("update", rel_error(&update_got, &update)),
            ("p_bf16", rel_error(&widen_bf16(&p16.download(stream)?), &p_got)),
        ],
        GPU_KERNEL_BF16,
    );

    // Random fill, row gather/scatter, cast and sum of squares.
    let fill_n = rng.random_range(1..=100_000);
    let fill_seed = rng.random::<u64>();
    let fill = Buf::<bf16>::zeros(stream, "fill", fill_n)?;
    k.fill_normal(fill.ptr(), fill_n, fill_seed, 0.5, 2.0)?;
    let fill_want: Vec<f64> = (0..fill_n as u64).map(|i| 0.5 + 2.0 * normal_at(fill_seed, i)).collect();
    let (src_rows, cols) = (rng.random_range(2..=50), rng.random_range(1..=700));
    let (src, srcf) = draw(src_rows * cols, 0.0, 1.0, &mut rng);
    let idx: Vec<u32> = (0..src_rows as u32).filter(|_| rng.random_bool(0.6)).collect();
    let (srcb, idxb) = (bf(&src)?, Buf::from_host(stream, "idx", &idx)?);
    let gathered = Buf::<bf16>::zeros(stream, "gathered", idx.len() * cols)?;
    k.copy_rows(false, srcb.ptr(), idxb.ptr(), gathered.ptr(), idx.len(), cols)?;
    let gather_want: Vec<f64> = idx.iter().flat_map(|&r| srcf[r as usize * cols..][..cols].to_vec()).collect();
    let scattered = Buf::<bf16>::zeros(stream, "scattered", src_rows * cols)?;
    k.copy_rows(true, gathered.ptr(), idxb.ptr(), scattered.ptr(), idx.len(), cols)?;
    let mut scatter_want = vec![0.0; src_rows * cols];
    for &r in &idx {
        let r = r as usize * cols;
        scatter_want[r..r + cols].copy_from_slice(&srcf[r..r + cols]);
    }
    let (_, castf) = draw(fill_n, 0.0, 3.0, &mut rng);
    let castb = f32s(&castf)?;
    let (stored, cast_want) = draw(fill_n, 0.0, 3.0, &mut rng);
    let cast = bf(&stored)?;
    let sq_partial = Buf::<f32>::zeros(stream, "partial", 64)?;
    k.sum_squares(false, castb.ptr(), sq_partial.ptr(), fill_n, 64)?;
    let sq_got: f64 = widen_f32(&sq_partial.download(stream)?).iter().sum();
    let sq_want: f64 = castf.iter().map(|&x| f64::from(x as f32).powi(2)).sum();
    k.sum_squares(true, cast.ptr(), sq_partial.ptr(), fill_n, 64)?;
    let sq16_got: f64 = widen_f32(&sq_partial.download(stream)?).iter().sum();
    let sq16_want: f64 = cast_want.iter().map(|x| x * x).sum();
    let (_, acc0) = draw(fill_n, 0.0, 1.0, &mut rng);
    let acc = f32s(&acc0)?;
    k.accumulate(acc.ptr(), cast.ptr(), fill_n)?;
    let acc_want: Vec<f64> = acc0.iter().zip(&cast_want).map(|(a, b)| f64::from(*a as f32) + b).collect();
    check(
        &format!("fill_normal, gather/scatter, sum_squares, accumulate [{fill_n}]"),
        vec![
            ("fill", rel_error(&widen_bf16(&fill.download(stream)?), &fill_want)),
            ("gather", rel_error(&widen_bf16(&gathered.download(stream)?), &gather_want)),
            ("scatter", rel_error(&widen_bf16(&scattered.download(stream)?), &scatter_want)),
            ("sum_squares f32", rel_error(&[sq_got], &[sq_want])),
            ("sum_squares bf16", rel_error(&[sq16_got], &[sq16_want])),
            ("accumulate_bf16", rel_error(&widen_f32(&acc.download(stream)?), &acc_want)),
        ],
        GPU_KERNEL_BF16,
    );
    Ok(checks)
}
