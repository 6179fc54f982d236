//! Launchers of the GatedDeltaNet kernels (`gdn.cu`) on raw device addresses. Each launcher checks
//! the sizes and alignments its kernel relies on and names the kernel in errors; the CPU twins are
//! `super::twin`, and `xtask gpu-conformance` checks each kernel against its twin.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use dflash_reference::hybrid::gdn::L2_NORM_EPS;

use super::{check_group, DeltaBuffers, DeltaScratch, GateInputs, GdnOps, GdnShape, Segments};
use crate::device::gpu::Gpu;
use crate::ops::constants::{
    GDN_CHUNK, GDN_CONV_TOKENS, GDN_MAX_CONV, GDN_MAX_HEAD_DIM, GDN_NORM_LANE_ELEMS, GDN_PAD, GDN_STATE_COLS,
    GDN_STATE_THREADS, GDN_THREADS, ROW_THREADS,
};
use crate::ops::elementwise::cuda::{grid, i32_of, launch_named, ElementwiseKernels};
use crate::ops::elementwise::Heads;
use crate::ops::sources::gdn_source;
use crate::{Error, Result};

/// Shared memory of `gated_delta_prepare` at head dims `(d_k, d_v)`: bf16 tiles k `[C, d_k+P]`,
/// v `[C, d_v+P]` and the two scaled UT inverses `[C, C+P]`; fp32 A and T `[C, C+1]`, gamma,
/// beta, the inverse norms and g `[C]`.
pub fn prepare_shared_bytes(dk: usize, dv: usize) -> usize {
    let (c, p) = (GDN_CHUNK, GDN_PAD);
    2 * c * (dk + p + dv + p + 2 * (c + p)) + 4 * (2 * c * (c + 1) + 4 * c)
}

/// Shared memory of `gated_delta_state` at key head dim `d_k`: two stages of bf16 W and k
/// `[C, d_k+P]` and fp32 U `[C, GDN_STATE_COLS+4]` and g `[C]`; the state's transpose
/// `[GDN_STATE_COLS, d_k+P]` and the scaled Delta `[C, GDN_STATE_COLS+P]` (bf16); fp32 gamma and
/// the inverse norms `[C]`.
pub fn state_shared_bytes(dk: usize) -> usize {
    let (c, p, cols) = (GDN_CHUNK, GDN_PAD, GDN_STATE_COLS);
    let stage = 2 * 2 * c * (dk + p) + 4 * c * (cols + 4 + 1);
    2 * stage + 2 * (cols * (dk + p) + c * (cols + p)) + 4 * 2 * c
}

/// Shared memory of `gated_delta_output` at head dims `(d_k, d_v)`: bf16 tiles q and k
/// `[C, d_k+P]`, the entering state `[d_k, d_v+P]`, Delta `[C, d_v+P]` and P `[C, C+P]`; fp32
/// gamma, the inverse norms of q and k, and g `[C]`.
pub fn output_shared_bytes(dk: usize, dv: usize) -> usize {
    let (c, p) = (GDN_CHUNK, GDN_PAD);
    2 * (2 * c * (dk + p) + dk * (dv + p) + c * (dv + p) + c * (c + p)) + 4 * 4 * c
}

/// The loaded `gdn.cu` kernels on one stream.
pub struct GdnKernels {
    stream: Arc<CudaStream>,
    conv1d_silu: CudaFunction,
    gdn_gates: CudaFunction,
    gated_delta_prepare: CudaFunction,
    gated_delta_state: CudaFunction,
    gated_delta_output: CudaFunction,
    gated_rms_norm: CudaFunction,
    partial_rope: CudaFunction,
    output_gate: CudaFunction,
}

impl GdnKernels {
    /// Compiles (once per process) and loads the kernels of `gpu`.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let function = |name: &str, smem: usize| -> Result<CudaFunction> {
            let f = gpu.function("gdn", gdn_source(), name)?;
            if smem > 48 * 1024 {
                f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                    .map_err(|e| Error::Gpu(format!("{name}: raising the dynamic shared memory limit: {e}")))?;
            }
            Ok(f)
        };
        let max = GDN_MAX_HEAD_DIM;
        Ok(GdnKernels {
            stream: gpu.stream().clone(),
            conv1d_silu: function("conv1d_silu", 0)?,
            gdn_gates: function("gdn_gates", 0)?,
            gated_delta_prepare: function("gated_delta_prepare", prepare_shared_bytes(max, max))?,
            gated_delta_state: function("gated_delta_state", state_shared_bytes(max))?,
            gated_delta_output: function("gated_delta_output", output_shared_bytes(max, max))?,
            gated_rms_norm: function("gated_rms_norm", 0)?,
            partial_rope: function("partial_rope", 0)?,
            output_gate: function("output_gate", 0)?,
        })
    }

    /// Refuses a conv the kernel does not take: more than [`GDN_MAX_CONV`] taps (channels are
    /// multiples of 8 when the head dims are multiples of 16).
    fn check_shape_conv(shape: GdnShape) -> Result<()> {
        if shape.conv_kernel > GDN_MAX_CONV {
            return Err(Error::invalid(
                "linear_conv_kernel_dim",
                format!("{}: the GPU conv kernel takes at most {GDN_MAX_CONV} taps", shape.conv_kernel),
            ));
        }
        Self::check_head_dims(shape)
    }

    /// Refuses head dims the delta-rule kernels do not take: multiples of 16 up to
    /// [`GDN_MAX_HEAD_DIM`].
    fn check_head_dims(shape: GdnShape) -> Result<()> {
        shape.check()?;
        for (name, d) in [("linear_key_head_dim", shape.key_head_dim), ("linear_value_head_dim", shape.value_head_dim)]
        {
            if d == 0 || !d.is_multiple_of(16) || d > GDN_MAX_HEAD_DIM {
                return Err(Error::invalid(
                    name,
                    format!("{d}: the GPU GatedDeltaNet kernels take a multiple of 16 up to {GDN_MAX_HEAD_DIM}"),
                ));
            }
        }
        Ok(())
    }
}

impl GdnOps for GdnKernels {
    fn check_shape(&self, shape: GdnShape) -> Result<()> {
        Self::check_shape_conv(shape)
    }

    fn conv1d_silu(&self, x: u64, w: u64, y: u64, shape: GdnShape, docs: Segments<'_>) -> Result<()> {
        shape.check_docs(docs.ranges)?;
        Self::check_shape_conv(shape)?;
        ElementwiseKernels::check_aligned("conv1d_silu", &[x, y])?;
        let channels = shape.conv_channels();
        let (t, c, k) =
            (i32_of("tokens", shape.tokens)?, i32_of("channels", channels)?, i32_of("conv", shape.conv_kernel)?);
        let mut b = self.stream.launch_builder(&self.conv1d_silu);
        b.arg(&x).arg(&w).arg(&y).arg(&docs.table).arg(&t).arg(&c).arg(&k);
        let cfg = LaunchConfig {
            grid_dim: (grid(channels / 8, ROW_THREADS), shape.tokens.div_ceil(GDN_CONV_TOKENS) as u32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch_named(&self.stream, "conv1d_silu", b, cfg)
    }

    fn gdn_gates(&self, inp: GateInputs, beta: u64, g: u64, shape: GdnShape) -> Result<()> {
        shape.check()?;
        i32_of("tokens x value heads", shape.tokens * shape.value_heads)?;
        let (t, h) = (i32_of("tokens", shape.tokens)?, i32_of("value heads", shape.value_heads)?);
        let mut b = self.stream.launch_builder(&self.gdn_gates);
        b.arg(&inp.b).arg(&inp.a).arg(&inp.a_log).arg(&inp.dt_bias).arg(&beta).arg(&g).arg(&t).arg(&h);
        launch_named(
            &self.stream,
            "gdn_gates",
            b,
            ElementwiseKernels::elementwise_cfg(shape.tokens * shape.value_heads),
        )
    }

    fn gated_delta(
        &self,
        buf: DeltaBuffers,
        s: DeltaScratch,
        shape: GdnShape,
        docs: Segments<'_>,
        group: Range<usize>,
    ) -> Result<()> {
        shape.check_docs(docs.ranges)?;
        check_group(docs.ranges, &group, shape)?;
        Self::check_head_dims(shape)?;
        ElementwiseKernels::check_aligned("gated_delta", &[buf.qkv, s.w, s.u, s.states])?;
        let (dk, dv) = (shape.key_head_dim, shape.value_head_dim);
        let t = i32_of("tokens", shape.tokens)?;
        let (hk, hv) = (i32_of("key heads", shape.key_heads)?, i32_of("value heads", shape.value_heads)?);
        let (dki, dvi) = (i32_of("d_k", dk)?, i32_of("d_v", dv)?);
        let (first, count) = (i32_of("chunk", group.start)?, i32_of("chunks", group.len())?);
        let slots = i32_of("state slots", shape.state_slots())?;
        let eps = L2_NORM_EPS as f32;
        let scale = (dk as f32).powf(-0.5);
        let cfg = |grid_dim: (u32, u32, u32), threads: usize, smem: usize| LaunchConfig {
            grid_dim,
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (chunks, heads) = (group.len() as u32, shape.value_heads as u32);

        let mut b = self.stream.launch_builder(&self.gated_delta_prepare);
        b.arg(&buf.qkv).arg(&buf.beta).arg(&buf.g).arg(&docs.table).arg(&s.w).arg(&s.u);
        b.arg(&t).arg(&first).arg(&hk).arg(&hv).arg(&dki).arg(&dvi).arg(&eps);
        let c = cfg((chunks, heads, 1), GDN_THREADS, prepare_shared_bytes(dk, dv));
        launch_named(&self.stream, "gated_delta_prepare", b, c)?;

        let mut b = self.stream.launch_builder(&self.gated_delta_state);
        b.arg(&buf.qkv).arg(&buf.g).arg(&docs.table).arg(&s.w).arg(&s.u).arg(&s.states).arg(&s.carry);
        b.arg(&t).arg(&first).arg(&count).arg(&slots).arg(&hk).arg(&hv).arg(&dki).arg(&dvi).arg(&eps);
        let c = cfg((heads, dv.div_ceil(GDN_STATE_COLS) as u32, 1), GDN_STATE_THREADS, state_shared_bytes(dk));
        launch_named(&self.stream, "gated_delta_state", b, c)?;

        let mut b = self.stream.launch_builder(&self.gated_delta_output);
        b.arg(&buf.qkv).arg(&buf.g).arg(&docs.table).arg(&s.u).arg(&s.states).arg(&buf.out);
        b.arg(&t).arg(&first).arg(&slots).arg(&hk).arg(&hv).arg(&dki).arg(&dvi).arg(&eps).arg(&scale);
        let c = cfg((chunks, heads, 1), GDN_THREADS, output_shared_bytes(dk, dv));
        launch_named(&self.stream, "gated_delta_output", b, c)
    }

    fn gated_rms_norm(&self, o: u64, z: u64, w: u64, y: u64, shape: GdnShape, eps: f64) -> Result<()> {
        shape.check()?;
        let dv = shape.value_head_dim;
        if dv > GDN_NORM_LANE_ELEMS * 32 {
            return Err(Error::invalid(
                "linear_value_head_dim",
                format!("{dv}: gated_rms_norm takes at most {}", GDN_NORM_LANE_ELEMS * 32),
            ));
        }
        let rows = shape.tokens * shape.value_heads;
        let (r, d, eps) = (i32_of("rows", rows)?, i32_of("d_v", dv)?, eps as f32);
        let mut b = self.stream.launch_builder(&self.gated_rms_norm);
        b.arg(&o).arg(&z).arg(&w).arg(&y).arg(&r).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (grid(rows, ROW_THREADS / 32), 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch_named(&self.stream, "gated_rms_norm", b, cfg)
    }

    fn partial_rope(&self, x: u64, cos: u64, sin: u64, y: u64, dims: Heads, rotary: usize) -> Result<()> {
        let Heads { tokens, heads, head_dim: d } = dims;
        if !rotary.is_multiple_of(2) || rotary > d {
            return Err(Error::invalid("rotary_dim", format!("{rotary}: must be even and at most head_dim {d}")));
        }
        let work = tokens * heads * (d - rotary / 2);
        if work == 0 {
            return Ok(());
        }
        let (t, h, dd, r) =
            (i32_of("tokens", tokens)?, i32_of("heads", heads)?, i32_of("head_dim", d)?, i32_of("rotary", rotary)?);
        let mut b = self.stream.launch_builder(&self.partial_rope);
        b.arg(&x).arg(&cos).arg(&sin).arg(&y).arg(&t).arg(&h).arg(&dd).arg(&r);
        launch_named(&self.stream, "partial_rope", b, ElementwiseKernels::elementwise_cfg(work))
    }

    fn output_gate(&self, x: u64, gate: u64, y: u64, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let len = n as i64;
        let mut b = self.stream.launch_builder(&self.output_gate);
        b.arg(&x).arg(&gate).arg(&y).arg(&len);
        launch_named(&self.stream, "output_gate", b, ElementwiseKernels::elementwise_cfg(n))
    }
}
