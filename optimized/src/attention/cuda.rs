//! The CUDA attention kernels (`kernels/attention.cu`): launch code, the plan on the device, and
//! the conformance and benchmark entry points that `cargo xtask gpu-conformance` and
//! `cargo xtask bench attention` call on the H200.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};
use dflash_reference::{Error, Result};
use half::bf16;

use super::cases::{rel_error, AttnCase, BenchTimes, CaseErrors};
use super::cpu::{attention_backward, attention_forward, AttnShape, TILE_K};
use super::plan::AttentionPlan;
use crate::gpu::Gpu;
use crate::profile;

const SOURCE: &str = include_str!("../../kernels/attention.cu");
/// Query rows staged per step of the key-major backward (`CHUNK` in the kernel).
const DKDV_CHUNK: usize = 64;
/// Rows of a warpgroup (`WG_ROWS` in the kernels).
const WG_ROWS: usize = 64;
/// Largest row group (rows times the query heads of a KV head): the CTA's two warpgroups.
const MAX_CTA_ROWS: usize = 2 * WG_ROWS;

fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e:?}"))
}

/// An attention plan uploaded to the device: the row groups (6 u32 each) and the KV-tile
/// group ranges (2 u32 each) of the key-major backward.
pub struct DevicePlan {
    pub plan: AttentionPlan,
    groups: CudaSlice<u32>,
    kv_ranges: CudaSlice<u32>,
}

impl DevicePlan {
    /// Uploads `plan`.
    pub fn upload(stream: &Arc<CudaStream>, plan: &AttentionPlan) -> Result<Self> {
        let groups: Vec<u32> =
            plan.groups.iter().flat_map(|g| [g.ctx_lo, g.ctx_hi, g.hi_step, g.win_base, g.blk_lo, g.blk_len]).collect();
        let kv_ranges: Vec<u32> = plan.kv_tile_group_ranges(TILE_K).into_iter().flat_map(|(a, b)| [a, b]).collect();
        let upload = |v: &[u32]| stream.clone_htod(if v.is_empty() { &[0u32][..] } else { v });
        Ok(DevicePlan {
            plan: plan.clone(),
            groups: upload(&groups).map_err(gpu_err("upload plan groups"))?,
            kv_ranges: upload(&kv_ranges).map_err(gpu_err("upload plan KV-tile ranges"))?,
        })
    }

    /// The plan's scalar kernel arguments.
    fn args(&self) -> PlanArgs {
        let p = &self.plan;
        PlanArgs {
            group_rows: p.group_rows as i32,
            num_queries: p.num_queries as i32,
            num_keys: p.num_keys as i32,
            window: p.window.map_or(0, |w| w as i32),
            causal_in_block: i32::from(p.causal_in_block),
        }
    }
}

/// The scalar plan arguments every attention kernel takes after its plan arrays, in order.
struct PlanArgs {
    group_rows: i32,
    num_queries: i32,
    num_keys: i32,
    window: i32,
    causal_in_block: i32,
}

impl PlanArgs {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.group_rows).arg(&self.num_queries).arg(&self.num_keys).arg(&self.window).arg(&self.causal_in_block);
    }
}

/// Head arguments every attention kernel ends with: `nh`, `nkv` and the score scale `d^-0.5`.
struct HeadArgs {
    num_heads: i32,
    num_kv_heads: i32,
    scale: f32,
}

impl HeadArgs {
    fn new(shape: AttnShape) -> Self {
        HeadArgs {
            num_heads: shape.num_heads as i32,
            num_kv_heads: shape.num_kv_heads as i32,
            scale: (shape.head_dim as f32).powf(-0.5),
        }
    }

    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.num_heads).arg(&self.num_kv_heads).arg(&self.scale);
    }
}

/// The attention kernels compiled for one head dim.
pub struct AttentionKernels {
    head_dim: usize,
    forward: CudaFunction,
    dsum: CudaFunction,
    dq: CudaFunction,
    dkdv: CudaFunction,
}

/// K/V stages of the query-major kernels (`KV_STAGES`).
const KV_STAGES: usize = 3;

/// Dynamic shared memory of the forward and the dQ pass: the stages of swizzled K and V tiles,
/// and 1024 bytes to align them (q and dout stay in registers).
fn query_major_smem(head_dim: usize) -> usize {
    1024 + KV_STAGES * 2 * TILE_K * head_dim * 2
}

/// Dynamic shared memory of the key-major pass: the K and V tiles and two stages of q and dout
/// rows with their lse, dsum and row group, each stage rounded to 1024 bytes.
fn dkdv_smem(head_dim: usize) -> usize {
    1024 + 2 * TILE_K * head_dim * 2 + 2 * (2 * DKDV_CHUNK * head_dim * 2 + DKDV_CHUNK * 8 + 32).next_multiple_of(1024)
}

impl AttentionKernels {
    /// Compiles (once per process and head dim) and loads the kernels; `head_dim` must be a
    /// multiple of 64 (the 128-byte panels of the swizzled tiles) up to 256.
    pub fn load(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(64) || head_dim > 256 {
            return Err(Error::invalid(
                "head_dim",
                format!("{head_dim}: the CUDA kernels need a multiple of 64 up to 256"),
            ));
        }
        let module: &'static str = Box::leak(format!("attention_d{head_dim}").into_boxed_str());
        let source: &'static str = Box::leak(format!("#define HEAD_DIM {head_dim}\n{SOURCE}").into_boxed_str());
        let function = |name: &str, smem: usize| -> Result<CudaFunction> {
            let f = gpu.function(module, source, name)?;
            if smem > 48 * 1024 {
                f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                    .map_err(gpu_err("raise the dynamic shared memory limit"))?;
            }
            Ok(f)
        };
        Ok(AttentionKernels {
            head_dim,
            forward: function("attention_forward", query_major_smem(head_dim))?,
            dsum: function("attention_backward_dsum", 0)?,
            dq: function("attention_backward_dq", query_major_smem(head_dim))?,
            dkdv: function("attention_backward_dkdv", dkdv_smem(head_dim))?,
        })
    }

    /// Checks the shapes; the number of query-major CTAs.
    fn check(&self, plan: &AttentionPlan, shape: AttnShape) -> Result<u32> {
        if shape.head_dim != self.head_dim {
            return Err(Error::invalid(
                "head_dim",
                format!("{} but the kernels were built for {}", shape.head_dim, self.head_dim),
            ));
        }
        if shape.num_kv_heads == 0 || !shape.num_heads.is_multiple_of(shape.num_kv_heads) {
            return Err(Error::invalid(
                "num_kv_heads",
                format!("{} does not divide {} query heads", shape.num_kv_heads, shape.num_heads),
            ));
        }
        let rows = plan.group_rows * (shape.num_heads / shape.num_kv_heads);
        if rows > MAX_CTA_ROWS {
            return Err(Error::invalid(
                "group_rows",
                format!(
                    "{} rows x {} heads per KV head exceed the kernels' {MAX_CTA_ROWS} rows per CTA",
                    plan.group_rows,
                    shape.num_heads / shape.num_kv_heads
                ),
            ));
        }
        // Two warpgroups per CTA: two groups of up to 64 rows, or one of up to 128.
        Ok((plan.groups.len() as u32).div_ceil(if rows <= WG_ROWS { 2 } else { 1 }))
    }

    /// Grid (KV heads, CTAs of row groups), two warpgroups per CTA.
    fn query_major_config(&self, shape: AttnShape, ctas: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (shape.num_kv_heads as u32, ctas, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: query_major_smem(self.head_dim) as u32,
        }
    }

    /// `out [Q, nh, d]` and `lse [nh, Q]` (natural log; -inf for rows that see nothing), all
    /// arguments device addresses: q `[Q, nh, d]`, k and v `[K, nkv, d]` bf16.
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        dp: &DevicePlan,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse): (u64, u64),
    ) -> Result<()> {
        let ctas = self.check(&dp.plan, shape)?;
        if ctas == 0 {
            return Ok(());
        }
        let (plan_args, head_args) = (dp.args(), HeadArgs::new(shape));
        let cfg = self.query_major_config(shape, ctas);
        let mut b = stream.launch_builder(&self.forward);
        b.arg(&dp.groups);
        plan_args.push(&mut b);
        b.arg(&q).arg(&k).arg(&v).arg(&out).arg(&lse);
        head_args.push(&mut b);
        profile::scope(
            stream,
            || "attention_forward".to_string(),
            || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_forward")),
        )?;
        Ok(())
    }

    /// `dq`, `dk`, `dv` (shaped like q, k, v) from the forward's `out` and `lse` and `dout`;
    /// `dsum [nh, Q]` (fp32) is scratch. All arguments are device addresses.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        stream: &Arc<CudaStream>,
        dp: &DevicePlan,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse, dout): (u64, u64, u64),
        dsum: u64,
        (dq, dk, dv): (u64, u64, u64),
    ) -> Result<()> {
        let ctas = self.check(&dp.plan, shape)?;
        let p = &dp.plan;
        let (plan_args, head_args) = (dp.args(), HeadArgs::new(shape));
        let pairs = (p.num_queries * shape.num_heads) as u32;
        if pairs > 0 {
            let cfg = LaunchConfig { grid_dim: (pairs.div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let mut b = stream.launch_builder(&self.dsum);
            b.arg(&out).arg(&dout).arg(&dsum).arg(&plan_args.num_queries).arg(&head_args.num_heads);
            profile::scope(
                stream,
                || "attention_backward_dsum".to_string(),
                || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_backward_dsum")),
            )?;
        }
        if ctas > 0 {
            let cfg = self.query_major_config(shape, ctas);
            let mut b = stream.launch_builder(&self.dq);
            b.arg(&dp.groups);
            plan_args.push(&mut b);
            b.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&dsum).arg(&dq);
            head_args.push(&mut b);
            profile::scope(
                stream,
                || "attention_backward_dq".to_string(),
                || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_backward_dq")),
            )?;
        }
        let tiles = p.num_keys.div_ceil(TILE_K) as u32;
        if tiles > 0 {
            let cfg = LaunchConfig {
                grid_dim: (shape.num_kv_heads as u32, tiles, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: dkdv_smem(self.head_dim) as u32,
            };
            let mut b = stream.launch_builder(&self.dkdv);
            b.arg(&dp.groups).arg(&dp.kv_ranges);
            plan_args.push(&mut b);
            b.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&dsum).arg(&dk).arg(&dv);
            head_args.push(&mut b);
            profile::scope(
                stream,
                || "attention_backward_dkdv".to_string(),
                || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_backward_dkdv")),
            )?;
        }
        Ok(())
    }
}

/// Draws `n` standard-normal values from `rng`, rounded to bf16 (the GPU gets exactly these).
fn random_bf16(n: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<bf16> {
    use rand_distr::{Distribution, StandardNormal};
    (0..n).map(|_| bf16::from_f32(StandardNormal.sample(rng))).collect()
}

fn widen(x: &[bf16]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// The inputs of a case on the host: q, k, v, dout (bf16), from the case's seed.
struct HostInputs {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    dout: Vec<bf16>,
}

impl HostInputs {
    fn draw(case: &AttnCase, plan: &AttentionPlan) -> Self {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(case.seed);
        let (nq, nk, d) = (plan.num_queries, plan.num_keys, case.head_dim);
        HostInputs {
            q: random_bf16(nq * case.num_heads * d, &mut rng),
            k: random_bf16(nk * case.num_kv_heads * d, &mut rng),
            v: random_bf16(nk * case.num_kv_heads * d, &mut rng),
            dout: random_bf16(nq * case.num_heads * d, &mut rng),
        }
    }
}

/// The device buffers of one forward + backward.
struct DeviceRun {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    dout: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    dsum: CudaSlice<f32>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
}

impl DeviceRun {
    fn upload_inputs(stream: &Arc<CudaStream>, host: &HostInputs) -> Result<[CudaSlice<bf16>; 4]> {
        let up = |x: &[bf16]| stream.clone_htod(x).map_err(gpu_err("upload attention inputs"));
        Ok([up(&host.q)?, up(&host.k)?, up(&host.v)?, up(&host.dout)?])
    }

    fn new(
        stream: &Arc<CudaStream>,
        inputs: [CudaSlice<bf16>; 4],
        plan: &AttentionPlan,
        shape: AttnShape,
    ) -> Result<Self> {
        let [q, k, v, dout] = inputs;
        let (nq, nk) = (plan.num_queries.max(1), plan.num_keys.max(1));
        let zeros_bf16 = |n: usize| stream.alloc_zeros::<bf16>(n).map_err(gpu_err("allocate attention outputs"));
        let zeros_f32 = |n: usize| stream.alloc_zeros::<f32>(n).map_err(gpu_err("allocate attention scratch"));
        Ok(DeviceRun {
            out: zeros_bf16(nq * shape.num_heads * shape.head_dim)?,
            lse: zeros_f32(shape.num_heads * nq)?,
            dsum: zeros_f32(shape.num_heads * nq)?,
            dq: zeros_bf16(nq * shape.num_heads * shape.head_dim)?,
            dk: zeros_bf16(nk * shape.num_kv_heads * shape.head_dim)?,
            dv: zeros_bf16(nk * shape.num_kv_heads * shape.head_dim)?,
            q,
            k,
            v,
            dout,
        })
    }

    fn forward(
        &mut self,
        kernels: &AttentionKernels,
        stream: &Arc<CudaStream>,
        dp: &DevicePlan,
        shape: AttnShape,
    ) -> Result<()> {
        let p = |x: &CudaSlice<bf16>| x.device_ptr(stream).0;
        kernels.forward(
            stream,
            dp,
            shape,
            (p(&self.q), p(&self.k), p(&self.v)),
            (p(&self.out), self.lse.device_ptr(stream).0),
        )
    }

    fn backward(
        &mut self,
        kernels: &AttentionKernels,
        stream: &Arc<CudaStream>,
        dp: &DevicePlan,
        shape: AttnShape,
    ) -> Result<()> {
        let p = |x: &CudaSlice<bf16>| x.device_ptr(stream).0;
        kernels.backward(
            stream,
            dp,
            shape,
            (p(&self.q), p(&self.k), p(&self.v)),
            (p(&self.out), self.lse.device_ptr(stream).0, p(&self.dout)),
            self.dsum.device_ptr(stream).0,
            (p(&self.dq), p(&self.dk), p(&self.dv)),
        )
    }
}

fn case_shape(case: &AttnCase) -> AttnShape {
    AttnShape { num_heads: case.num_heads, num_kv_heads: case.num_kv_heads, head_dim: case.head_dim }
}

/// Largest `Q * K * heads` for which the conformance run also checks against the reference's
/// dense attention (above it, the dense score matrix makes the CPU check too slow; the CPU twin,
/// itself proven equal to the reference in CI, is the oracle for every case).
const DENSE_REFERENCE_LIMIT: usize = 20_000_000;

/// Runs `case` on the GPU and returns the worst relative error of out, dq, dk, dv against the
/// CPU twin in f64 and, for cases small enough, the reference's dense attention in f64.
pub fn conformance_case(gpu: &Gpu, case: &AttnCase) -> Result<CaseErrors> {
    let plan = case.plan()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &plan);
    let stream = gpu.stream();
    let kernels = AttentionKernels::load(gpu, case.head_dim)?;
    let dp = DevicePlan::upload(stream, &plan)?;
    let mut run = DeviceRun::new(stream, DeviceRun::upload_inputs(stream, &host)?, &plan, shape)?;
    run.forward(&kernels, stream, &dp, shape)?;
    run.backward(&kernels, stream, &dp, shape)?;
    let down = |x: &CudaSlice<bf16>| -> Result<Vec<f64>> {
        Ok(widen(&stream.clone_dtoh(x).map_err(gpu_err("download results"))?))
    };
    let got = [down(&run.out)?, down(&run.dq)?, down(&run.dk)?, down(&run.dv)?];
    let scale = (case.head_dim as f64).powf(-0.5);
    let (q, k, v, dout) = (widen(&host.q), widen(&host.k), widen(&host.v), widen(&host.dout));
    let (out, lse) = attention_forward(&plan, shape, &q, &k, &v, scale)?;
    let (dq, dk, dv) = attention_backward(&plan, shape, &q, &k, &v, &out, &lse, &dout, scale)?;
    let mut worst = [out, dq, dk, dv].iter().zip(&got).map(|(want, got)| rel_error(got, want)).collect::<Vec<_>>();
    if plan.num_queries * plan.num_keys * case.num_heads <= DENSE_REFERENCE_LIMIT {
        let dense = dense_reference(case, &plan, shape, [&q, &k, &v, &dout])?;
        for (w, (want, got)) in worst.iter_mut().zip(dense.iter().zip(&got)) {
            *w = w.max(rel_error(got, want));
        }
    }
    Ok(CaseErrors { out: worst[0], dq: worst[1], dk: worst[2], dv: worst[3] })
}

/// out, dq, dk, dv of the reference's dense attention (f64, candle autograd of `sum(out*dout)`)
/// with the dense mask of the case's layout (spec section 2) or the causal mask.
fn dense_reference(
    case: &AttnCase,
    plan: &AttentionPlan,
    shape: AttnShape,
    [q, k, v, dout]: [&Vec<f64>; 4],
) -> Result<[Vec<f64>; 4]> {
    use candle_core::{Device, Tensor, Var};
    let mask = match case.block_layout()? {
        Some(layout) => layout.dense(case.kind),
        None => dflash_reference::mask::causal_dense(case.kind, plan.num_queries),
    };
    let (nq, nk, d) = (plan.num_queries, plan.num_keys, shape.head_dim);
    let var = |x: &Vec<f64>, rows: usize, heads: usize| {
        Var::from_tensor(&Tensor::from_vec(x.clone(), (rows, heads, d), &Device::Cpu)?)
    };
    let (tq, tk, tv) = (var(q, nq, shape.num_heads)?, var(k, nk, shape.num_kv_heads)?, var(v, nk, shape.num_kv_heads)?);
    let out = dflash_reference::attention::dense_attention(tq.as_tensor(), tk.as_tensor(), tv.as_tensor(), &mask)?;
    let td = Tensor::from_vec(dout.clone(), (nq, shape.num_heads, d), &Device::Cpu)?;
    let grads = (&out * &td)?.sum_all()?.backward()?;
    let flat = |t: &Tensor| -> Result<Vec<f64>> { Ok(t.flatten_all()?.to_vec1::<f64>()?) };
    let grad = |x: &Var| -> Result<Vec<f64>> {
        match grads.get(x.as_tensor()) {
            Some(g) => flat(g),
            None => Ok(vec![0.0; x.elem_count()]),
        }
    };
    Ok([flat(&out)?, grad(&tq)?, grad(&tk)?, grad(&tv)?])
}

/// Times the forward and forward+backward of `case` (CUDA events, median after `warmup`), and
/// measures the memory-pool growth of one forward+backward against the planned bytes.
pub fn bench_case(gpu: &Gpu, case: &AttnCase, warmup: usize, iters: usize) -> Result<BenchTimes> {
    let plan = case.plan()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &plan);
    let stream = gpu.stream();
    let kernels = &AttentionKernels::load(gpu, case.head_dim)?;
    let dp = DevicePlan::upload(stream, &plan)?;
    let inputs = DeviceRun::upload_inputs(stream, &host)?;
    let before = gpu.pool_used()?;
    gpu.reset_pool_high()?;
    let mut run = DeviceRun::new(stream, inputs, &plan, shape)?;
    run.forward(kernels, stream, &dp, shape)?;
    run.backward(kernels, stream, &dp, shape)?;
    let extra_bytes = gpu.pool_used_high()?.saturating_sub(before);
    let fwd_ms = gpu.time_ms(warmup, iters, || run.forward(kernels, stream, &dp, shape))?;
    let fwdbwd_ms = gpu.time_ms(warmup, iters, || {
        run.forward(kernels, stream, &dp, shape)?;
        run.backward(kernels, stream, &dp, shape)
    })?;
    Ok(BenchTimes { fwd_ms, fwdbwd_ms, extra_bytes, planned_extra_bytes: planned_extra_bytes(&plan, shape) as u64 })
}

/// The planner's bound on what one forward+backward allocates beyond its inputs: out and dq
/// (`[Q, nh, d]` bf16), dk and dv (`[K, nkv, d]` bf16), lse and dsum (`[nh, Q]` f32). The
/// kernels allocate nothing else: no score matrix, no mask, no expanded K/V.
pub fn planned_extra_bytes(plan: &AttentionPlan, shape: AttnShape) -> usize {
    let (nq, nk, d) = (plan.num_queries, plan.num_keys, shape.head_dim);
    2 * (2 * nq * shape.num_heads * d) + 2 * (2 * nk * shape.num_kv_heads * d) + 2 * (4 * shape.num_heads * nq)
}
