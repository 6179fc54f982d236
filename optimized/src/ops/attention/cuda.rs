//! The launcher of the CUDA attention kernels (`attention.cu`): the key ranges on the device and
//! the launches, each checking the shapes its kernel relies on.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg};

use super::ranges::KeyRanges;
use super::AttnShape;
use crate::device::gpu::Gpu;
use crate::device::profile;
use crate::device::staging::UploadRing;
use crate::ops::bytes_of;
use crate::ops::constants::{forward_threads, forward_tile_k, DKDV_CHUNK, KV_STAGES, TILE_K, WG_ROWS};
use crate::ops::sources::{attention_source, ATTENTION_HEAD_DIMS};
use crate::{Error, Result};

/// Largest row group (rows times the query heads of a KV head): the CTA's two warpgroups.
const MAX_CTA_ROWS: usize = 2 * WG_ROWS;

fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e:?}"))
}

/// An attention plan uploaded to the device in one copy: the row groups (6 u32 each), then the
/// KV-tile group ranges (2 u32 each) of the key-major backward (`memory::attention::
/// key_ranges_bytes`, to the byte). An empty list's address is where it would start, never read
/// (its kernel launches no CTA for it); one 0 when both are empty, so that there is a buffer.
pub struct DeviceKeyRanges {
    pub plan: KeyRanges,
    /// Owns the memory `groups` and `kv_ranges` point into.
    _data: CudaSlice<u32>,
    groups: u64,
    kv_ranges: u64,
}

impl DeviceKeyRanges {
    /// The words `upload` copies and where the KV-tile ranges start among them (what the memory
    /// plan counts: `memory::attention::key_ranges_bytes`).
    pub fn words(plan: &KeyRanges) -> (Vec<u32>, usize) {
        let mut words: Vec<u32> =
            plan.groups.iter().flat_map(|g| [g.ctx_lo, g.ctx_hi, g.hi_step, g.win_base, g.blk_lo, g.blk_len]).collect();
        let kv_at = words.len();
        words.extend(plan.kv_tile_group_ranges(TILE_K).into_iter().flat_map(|(a, b)| [a, b]));
        if words.is_empty() {
            words.push(0);
        }
        (words, kv_at)
    }

    /// Uploads `plan` in one copy from pageable memory (it waits for the work queued before it).
    pub fn upload(stream: &Arc<CudaStream>, plan: &KeyRanges) -> Result<Self> {
        let (words, kv_at) = Self::words(plan);
        let data = stream.clone_htod(&words).map_err(gpu_err("upload an attention plan"))?;
        Ok(Self::over(stream, plan, data, kv_at))
    }

    /// [`DeviceKeyRanges::upload`] staged through `ring`: queued without waiting for the work
    /// before it (a decode step's plans); from pageable memory when larger than a slot.
    pub fn upload_staged(stream: &Arc<CudaStream>, plan: &KeyRanges, ring: &mut UploadRing) -> Result<Self> {
        let (words, kv_at) = Self::words(plan);
        // SAFETY: written by the copy below before any kernel reads it (stream order).
        let mut data = unsafe { stream.alloc::<u32>(words.len()) }.map_err(gpu_err("allocate an attention plan"))?;
        let dst = data.device_ptr(stream).0;
        // SAFETY: `data` holds the words and is freed in stream order, after the copy.
        if !unsafe { ring.upload(stream, dst, bytes_of(&words))? } {
            stream.memcpy_htod(&words, &mut data).map_err(gpu_err("upload an attention plan"))?;
        }
        Ok(Self::over(stream, plan, data, kv_at))
    }

    fn over(stream: &Arc<CudaStream>, plan: &KeyRanges, data: CudaSlice<u32>, kv_at: usize) -> Self {
        let base = data.device_ptr(stream).0;
        let kv_ranges = base + (kv_at * std::mem::size_of::<u32>()) as u64;
        DeviceKeyRanges { plan: plan.clone(), _data: data, groups: base, kv_ranges }
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

/// Dynamic shared memory of the forward (`tile_k` = [`forward_tile_k`]) and the dQ pass
/// (`TILE_K`): `KV_STAGES` stages of swizzled K and V tiles of `tile_k` keys and `head_dim`, and
/// 1024 bytes to align them (q and dout stay in registers).
pub fn query_major_shared_bytes(head_dim: usize, tile_k: usize) -> usize {
    1024 + KV_STAGES * 2 * tile_k * head_dim * 2
}

/// Dynamic shared memory of the forward: its K/V ring and, for the warp-specialised forward
/// ([`forward_threads`] 384), the ring's full and empty mbarriers (8 bytes each).
pub fn forward_shared_bytes(head_dim: usize) -> usize {
    let barriers = if forward_threads(head_dim) > 256 { 2 * KV_STAGES * 8 } else { 0 };
    query_major_shared_bytes(head_dim, forward_tile_k(head_dim)) + barriers
}

/// One stage of the key-major pass: swizzled q and dout rows (`DKDV_CHUNK` x `head_dim` bf16
/// each), their lse and dsum (fp32) and the row group (32 bytes), rounded to 1024 bytes. Injected
/// into the kernel as `DKDV_STAGE_BYTES`.
pub fn dkdv_stage_bytes(head_dim: usize) -> usize {
    (2 * DKDV_CHUNK * head_dim * 2 + DKDV_CHUNK * 8 + 32).next_multiple_of(1024)
}

/// Dynamic shared memory of the key-major pass: the K and V tiles and two stages, and 1024 bytes
/// to align them.
pub fn dkdv_shared_bytes(head_dim: usize) -> usize {
    1024 + 2 * TILE_K * head_dim * 2 + 2 * dkdv_stage_bytes(head_dim)
}

impl AttentionKernels {
    /// Compiles (once per process and head dim) and loads the kernels; `head_dim` must be a
    /// multiple of 64 (the 128-byte panels of the swizzled tiles) up to 256.
    pub fn load(gpu: &Gpu, head_dim: usize) -> Result<Self> {
        if !ATTENTION_HEAD_DIMS.contains(&head_dim) {
            return Err(Error::invalid(
                "head_dim",
                format!("{head_dim}: the CUDA kernels are built for {ATTENTION_HEAD_DIMS:?}"),
            ));
        }
        let module: &'static str = Box::leak(format!("attention_d{head_dim}").into_boxed_str());
        let source: &'static str = Box::leak(attention_source(head_dim).into_boxed_str());
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
            forward: function("attention_forward", forward_shared_bytes(head_dim))?,
            dsum: function("attention_backward_dsum", 0)?,
            dq: function("attention_backward_dq", query_major_shared_bytes(head_dim, TILE_K))?,
            dkdv: function("attention_backward_dkdv", dkdv_shared_bytes(head_dim))?,
        })
    }

    /// Checks the shapes; the number of query-major CTAs.
    fn check(&self, plan: &KeyRanges, shape: AttnShape) -> Result<u32> {
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

    /// Grid (KV heads, CTAs of row groups), two computing warpgroups per CTA (`threads`: the dQ
    /// pass's 256, the forward's [`forward_threads`]), `smem` bytes of shared memory.
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
        dp: &DeviceKeyRanges,
        shape: AttnShape,
        (q, k, v): (u64, u64, u64),
        (out, lse): (u64, u64),
    ) -> Result<()> {
        let ctas = self.check(&dp.plan, shape)?;
        if ctas == 0 {
            return Ok(());
        }
        let (plan_args, head_args) = (dp.args(), HeadArgs::new(shape));
        let cfg = self.query_major_config(
            shape,
            ctas,
            forward_threads(self.head_dim) as u32,
            forward_shared_bytes(self.head_dim),
        );
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
        dp: &DeviceKeyRanges,
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
            let cfg = self.query_major_config(shape, ctas, 256, query_major_shared_bytes(self.head_dim, TILE_K));
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
                shared_mem_bytes: dkdv_shared_bytes(self.head_dim) as u32,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The most dynamic shared memory a CTA may opt into on compute capability 9.0 (H100, H200):
    /// 227 KB (CUDA C++ Programming Guide, the compute capabilities' technical specifications).
    const SM90_MAX_DYNAMIC_SHARED: usize = 227 * 1024;

    #[test]
    fn every_attention_kernel_fits_the_shared_memory_of_a_cta() {
        for d in ATTENTION_HEAD_DIMS {
            let kernels = [
                ("forward", forward_shared_bytes(d)),
                ("dQ", query_major_shared_bytes(d, TILE_K)),
                ("dK/dV", dkdv_shared_bytes(d)),
            ];
            for (kernel, bytes) in kernels {
                assert!(
                    bytes <= SM90_MAX_DYNAMIC_SHARED,
                    "head dim {d}: the {kernel} kernel asks for {bytes} bytes of shared memory, above {SM90_MAX_DYNAMIC_SHARED}"
                );
            }
            // The warp-specialised forward's mbarriers follow the ring: 8-byte aligned.
            assert_eq!((query_major_shared_bytes(d, forward_tile_k(d)) - 1024) % 8, 0, "head dim {d}");
            assert!(matches!(forward_threads(d), 256 | 384), "head dim {d}: two or three warpgroups");
        }
    }
}
