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
/// Largest CTA of the query-major kernels: 16 rows per warp, at most 8 warps.
const MAX_CTA_ROWS: usize = 128;
/// Rows of a warpgroup in the wgmma kernels (`WG_ROWS`).
const WG_ROWS: usize = 64;

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

/// Which kernels run. Both compute the same results over the same plan and take the same
/// arguments; they differ in tensor-core instructions, shared layout and CTA shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelVariant {
    /// `mma.sync` m16n8k16 on padded shared tiles: 16 rows per warp, one row group per CTA.
    MmaSync,
    /// Hopper `wgmma` on 128-byte-swizzled shared tiles: 64 rows per warpgroup, two warpgroups
    /// per CTA (two row groups of up to 64 rows share each K/V tile); head_dim a multiple of 64.
    Wgmma,
}

impl KernelVariant {
    pub const ALL: [KernelVariant; 2] = [KernelVariant::MmaSync, KernelVariant::Wgmma];

    pub fn name(self) -> &'static str {
        match self {
            KernelVariant::MmaSync => "mma-sync",
            KernelVariant::Wgmma => "wgmma",
        }
    }

    /// Kernel-name suffix in `attention.cu`.
    fn suffix(self) -> &'static str {
        match self {
            KernelVariant::MmaSync => "",
            KernelVariant::Wgmma => "_wg",
        }
    }
}

impl std::str::FromStr for KernelVariant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown kernel variant `{s}` (mma-sync or wgmma)"))
    }
}

/// The variant the training step and `AttentionKernels::load` use.
pub const DEFAULT_VARIANT: KernelVariant = KernelVariant::MmaSync;

/// The attention kernels compiled for one head dim.
pub struct AttentionKernels {
    head_dim: usize,
    variant: KernelVariant,
    forward: CudaFunction,
    dsum: CudaFunction,
    dq: CudaFunction,
    dkdv: CudaFunction,
    dkdv_finish: CudaFunction,
}

/// Dynamic shared memory of the forward: two stages of K and V tiles (wgmma: swizzled, plus
/// 1024 bytes to align them; q stays in registers).
fn forward_smem(variant: KernelVariant, head_dim: usize) -> usize {
    match variant {
        KernelVariant::MmaSync => 2 * 2 * TILE_K * (head_dim + 8) * 2,
        KernelVariant::Wgmma => 1024 + 4 * TILE_K * head_dim * 2,
    }
}

/// Dynamic shared memory of the dQ pass: the forward's, plus the CTA's dout rows (mma.sync;
/// wgmma keeps them in registers).
fn dq_smem(variant: KernelVariant, head_dim: usize) -> usize {
    match variant {
        KernelVariant::MmaSync => forward_smem(variant, head_dim) + MAX_CTA_ROWS * (head_dim + 8) * 2,
        KernelVariant::Wgmma => forward_smem(variant, head_dim),
    }
}

/// Dynamic shared memory of the key-major backward: K and V tiles, and two stages of q and
/// dout rows with their lse, dsum and row bounds (wgmma: stages rounded to 1024 bytes).
fn dkdv_smem(variant: KernelVariant, head_dim: usize) -> usize {
    let scalars = DKDV_CHUNK * (4 + 4 + 16);
    match variant {
        KernelVariant::MmaSync => 2 * TILE_K * (head_dim + 8) * 2 + 2 * (2 * DKDV_CHUNK * (head_dim + 8) * 2 + scalars),
        // Per stage: lse and dsum per row, and the chunk's row group.
        KernelVariant::Wgmma => {
            1024 + 2 * TILE_K * head_dim * 2
                + 2 * (2 * DKDV_CHUNK * head_dim * 2 + DKDV_CHUNK * 8 + 32).next_multiple_of(1024)
        }
    }
}

impl AttentionKernels {
    pub fn variant(&self) -> KernelVariant {
        self.variant
    }

    /// The default variant's kernels ([`DEFAULT_VARIANT`]).
    pub fn load(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        Self::load_variant(gpu, head_dim, DEFAULT_VARIANT)
    }

    /// Compiles (once per process and head dim) and loads the kernels of `variant`; `head_dim`
    /// must be a multiple of 32 (mma.sync: fragments load two k-steps at a time) or of 64 (wgmma:
    /// 128-byte panels), up to 256.
    pub fn load_variant(gpu: &Gpu, head_dim: usize, variant: KernelVariant) -> Result<Self> {
        let granule = match variant {
            KernelVariant::MmaSync => 32,
            KernelVariant::Wgmma => 64,
        };
        if head_dim == 0 || !head_dim.is_multiple_of(granule) || head_dim > 256 {
            return Err(Error::invalid(
                "head_dim",
                format!("{head_dim}: the {} kernels need a multiple of {granule} up to 256", variant.name()),
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
        let sfx = variant.suffix();
        Ok(AttentionKernels {
            head_dim,
            variant,
            forward: function(&format!("attention_forward{sfx}"), forward_smem(variant, head_dim))?,
            dsum: function("attention_backward_dsum", 0)?,
            dq: function(&format!("attention_backward_dq{sfx}"), dq_smem(variant, head_dim))?,
            dkdv: function(&format!("attention_backward_dkdv{sfx}"), dkdv_smem(variant, head_dim))?,
            dkdv_finish: function("attention_dkdv_finish", 0)?,
        })
    }

    fn check(&self, plan: &AttentionPlan, shape: AttnShape) -> Result<(u32, u32)> {
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
        let groups = plan.groups.len() as u32;
        Ok(match self.variant {
            // One group per CTA, one warp per 16 rows.
            KernelVariant::MmaSync => (groups, rows.div_ceil(16) as u32 * 32),
            // Two warpgroups: two groups of up to 64 rows per CTA, or one of up to 128.
            KernelVariant::Wgmma => (groups.div_ceil(if rows <= WG_ROWS { 2 } else { 1 }), 256),
        })
    }

    /// Grid (KV heads, CTAs of row groups).
    fn query_major_config(&self, shape: AttnShape, ctas: u32, threads: u32, smem: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (shape.num_kv_heads as u32, ctas, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
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
        let (ctas, threads) = self.check(&dp.plan, shape)?;
        if ctas == 0 {
            return Ok(());
        }
        let (plan_args, head_args) = (dp.args(), HeadArgs::new(shape));
        let cfg = self.query_major_config(shape, ctas, threads, forward_smem(self.variant, self.head_dim));
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
    /// `dsum [nh, Q]` (fp32) is scratch. With `split` (two fp32 accumulators shaped like k), the
    /// mma.sync key-major pass runs each KV tile's work in two halves on two CTAs (the DFlash
    /// context tiles seen by every block no longer set the critical path) and adds them up there;
    /// the wgmma pass ignores `split`. All arguments are device addresses.
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
        split: Option<(u64, u64)>,
    ) -> Result<()> {
        let (ctas, threads) = self.check(&dp.plan, shape)?;
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
            let cfg = self.query_major_config(shape, ctas, threads, dq_smem(self.variant, self.head_dim));
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
        let kv_len = p.num_keys * shape.num_kv_heads * shape.head_dim;
        let (splits, (dk_acc, dv_acc)) = match (self.variant, split) {
            (KernelVariant::MmaSync, Some(acc)) => (2, acc),
            _ => (1, (0, 0)),
        };
        let accumulators = dk_acc != 0;
        if accumulators {
            for acc in [dk_acc, dv_acc] {
                crate::step::gpu::device::zero_device(stream, acc, kv_len * 4)?;
            }
        }
        if tiles > 0 {
            let cfg = LaunchConfig {
                grid_dim: (shape.num_kv_heads as u32, tiles, splits),
                block_dim: (128, 1, 1),
                shared_mem_bytes: dkdv_smem(self.variant, self.head_dim) as u32,
            };
            let mut b = stream.launch_builder(&self.dkdv);
            b.arg(&dp.groups).arg(&dp.kv_ranges);
            plan_args.push(&mut b);
            b.arg(&q).arg(&k).arg(&v).arg(&dout).arg(&lse).arg(&dsum).arg(&dk).arg(&dv).arg(&dk_acc).arg(&dv_acc);
            head_args.push(&mut b);
            profile::scope(
                stream,
                || "attention_backward_dkdv".to_string(),
                || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_backward_dkdv")),
            )?;
        }
        if accumulators && kv_len > 0 {
            let n = kv_len as i64;
            let cfg = LaunchConfig {
                grid_dim: ((kv_len.div_ceil(256) as u32).min(2112), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = stream.launch_builder(&self.dkdv_finish);
            b.arg(&dk_acc).arg(&dv_acc).arg(&dk).arg(&dv).arg(&n);
            profile::scope(
                stream,
                || "attention_dkdv_finish".to_string(),
                || unsafe { b.launch(cfg) }.map_err(gpu_err("launch attention_dkdv_finish")),
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
        split: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
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
            split.map(|(dk_acc, dv_acc)| (dk_acc.device_ptr(stream).0, dv_acc.device_ptr(stream).0)),
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
pub fn conformance_case(gpu: &Gpu, case: &AttnCase, variant: KernelVariant) -> Result<CaseErrors> {
    let plan = case.plan()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &plan);
    let stream = gpu.stream();
    let kernels = AttentionKernels::load_variant(gpu, case.head_dim, variant)?;
    let dp = DevicePlan::upload(stream, &plan)?;
    let mut run = DeviceRun::new(stream, DeviceRun::upload_inputs(stream, &host)?, &plan, shape)?;
    run.forward(&kernels, stream, &dp, shape)?;
    run.backward(&kernels, stream, &dp, shape, None)?;
    let down = |x: &CudaSlice<bf16>| -> Result<Vec<f64>> {
        Ok(widen(&stream.clone_dtoh(x).map_err(gpu_err("download results"))?))
    };
    let got = [down(&run.out)?, down(&run.dq)?, down(&run.dk)?, down(&run.dv)?];
    // The split key-major pass (mma.sync: the training step's, into fp32 accumulators; wgmma
    // ignores the split) into the same outputs.
    let kv_len = plan.num_keys.max(1) * shape.num_kv_heads * shape.head_dim;
    let acc = || stream.alloc_zeros::<f32>(kv_len).map_err(gpu_err("allocate dK/dV accumulators"));
    let (dk_acc, dv_acc) = (acc()?, acc()?);
    run.backward(&kernels, stream, &dp, shape, Some((&dk_acc, &dv_acc)))?;
    let got_split = [down(&run.dk)?, down(&run.dv)?];

    let scale = (case.head_dim as f64).powf(-0.5);
    let (q, k, v, dout) = (widen(&host.q), widen(&host.k), widen(&host.v), widen(&host.dout));
    let (out, lse) = attention_forward(&plan, shape, &q, &k, &v, scale)?;
    let (dq, dk, dv) = attention_backward(&plan, shape, &q, &k, &v, &out, &lse, &dout, scale)?;
    let mut worst =
        [out, dq, dk.clone(), dv.clone()].iter().zip(&got).map(|(want, got)| rel_error(got, want)).collect::<Vec<_>>();
    worst[2] = worst[2].max(rel_error(&got_split[0], &dk));
    worst[3] = worst[3].max(rel_error(&got_split[1], &dv));
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
pub fn bench_case(
    gpu: &Gpu,
    case: &AttnCase,
    kernels: &AttentionKernels,
    warmup: usize,
    iters: usize,
) -> Result<BenchTimes> {
    let plan = case.plan()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &plan);
    let stream = gpu.stream();
    let dp = DevicePlan::upload(stream, &plan)?;
    let inputs = DeviceRun::upload_inputs(stream, &host)?;
    let before = gpu.pool_used()?;
    gpu.reset_pool_high()?;
    let mut run = DeviceRun::new(stream, inputs, &plan, shape)?;
    run.forward(kernels, stream, &dp, shape)?;
    run.backward(kernels, stream, &dp, shape, None)?;
    let extra_bytes = gpu.pool_used_high()?.saturating_sub(before);
    let fwd_ms = gpu.time_ms(warmup, iters, || run.forward(kernels, stream, &dp, shape))?;
    let fwdbwd_ms = gpu.time_ms(warmup, iters, || {
        run.forward(kernels, stream, &dp, shape)?;
        run.backward(kernels, stream, &dp, shape, None)
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
