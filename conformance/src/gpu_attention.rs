//! The GPU attention checks that `xtask gpu-conformance` runs on the H200: each case's CUDA
//! forward and backward against the CPU twin in f64 and, where small enough, the reference's
//! dense attention; the device buffers of one case, shared with `xtask bench attention`.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::ops::attention::cuda::{AttentionKernels, DeviceKeyRanges};
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::attention::twin::{attention_backward, attention_forward};
use dflash_optimized::ops::attention::AttnShape;
use dflash_optimized::{Error, Result};
use half::bf16;

use crate::attention_cases::{rel_error, AttnCase, CaseErrors};

fn gpu_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e:?}"))
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
pub struct HostInputs {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    dout: Vec<bf16>,
}

impl HostInputs {
    pub fn draw(case: &AttnCase, ranges: &KeyRanges) -> Self {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(case.seed);
        let (nq, nk, d) = (ranges.num_queries, ranges.num_keys, case.head_dim);
        HostInputs {
            q: random_bf16(nq * case.num_heads * d, &mut rng),
            k: random_bf16(nk * case.num_kv_heads * d, &mut rng),
            v: random_bf16(nk * case.num_kv_heads * d, &mut rng),
            dout: random_bf16(nq * case.num_heads * d, &mut rng),
        }
    }
}

/// The device buffers of one forward + backward.
pub struct DeviceRun {
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
    pub fn upload_inputs(stream: &Arc<CudaStream>, host: &HostInputs) -> Result<[CudaSlice<bf16>; 4]> {
        let up = |x: &[bf16]| stream.clone_htod(x).map_err(gpu_err("upload attention inputs"));
        Ok([up(&host.q)?, up(&host.k)?, up(&host.v)?, up(&host.dout)?])
    }

    pub fn new(
        stream: &Arc<CudaStream>,
        inputs: [CudaSlice<bf16>; 4],
        ranges: &KeyRanges,
        shape: AttnShape,
    ) -> Result<Self> {
        let [q, k, v, dout] = inputs;
        let (nq, nk) = (ranges.num_queries.max(1), ranges.num_keys.max(1));
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

    pub fn forward(
        &mut self,
        kernels: &AttentionKernels,
        stream: &Arc<CudaStream>,
        dr: &DeviceKeyRanges,
        shape: AttnShape,
    ) -> Result<()> {
        let p = |x: &CudaSlice<bf16>| x.device_ptr(stream).0;
        kernels.forward(
            stream,
            dr,
            shape,
            (p(&self.q), p(&self.k), p(&self.v)),
            (p(&self.out), self.lse.device_ptr(stream).0),
        )
    }

    pub fn backward(
        &mut self,
        kernels: &AttentionKernels,
        stream: &Arc<CudaStream>,
        dr: &DeviceKeyRanges,
        shape: AttnShape,
    ) -> Result<()> {
        let p = |x: &CudaSlice<bf16>| x.device_ptr(stream).0;
        kernels.backward(
            stream,
            dr,
            shape,
            (p(&self.q), p(&self.k), p(&self.v)),
            (p(&self.out), self.lse.device_ptr(stream).0, p(&self.dout)),
            self.dsum.device_ptr(stream).0,
            (p(&self.dq), p(&self.dk), p(&self.dv)),
        )
    }
}

pub fn case_shape(case: &AttnCase) -> AttnShape {
    AttnShape { num_heads: case.num_heads, num_kv_heads: case.num_kv_heads, head_dim: case.head_dim }
}

/// Largest `Q * K * heads` for which the conformance run also checks against the reference's
/// dense attention (above it, the dense score matrix makes the CPU check too slow; the CPU twin,
/// itself proven equal to the reference in CI, is the oracle for every case).
const DENSE_REFERENCE_LIMIT: usize = 20_000_000;

/// Runs `case` on the GPU and returns the worst relative error of out, dq, dk, dv against the
/// CPU twin in f64 and, for cases small enough, the reference's dense attention in f64.
pub fn conformance_case(gpu: &Gpu, case: &AttnCase) -> Result<CaseErrors> {
    let ranges = case.ranges()?;
    let shape = case_shape(case);
    let host = HostInputs::draw(case, &ranges);
    let stream = gpu.stream();
    let kernels = AttentionKernels::load(gpu, case.head_dim)?;
    let dr = DeviceKeyRanges::upload(stream, &ranges)?;
    let mut run = DeviceRun::new(stream, DeviceRun::upload_inputs(stream, &host)?, &ranges, shape)?;
    run.forward(&kernels, stream, &dr, shape)?;
    run.backward(&kernels, stream, &dr, shape)?;
    let down = |x: &CudaSlice<bf16>| -> Result<Vec<f64>> {
        Ok(widen(&stream.clone_dtoh(x).map_err(gpu_err("download results"))?))
    };
    let got = [down(&run.out)?, down(&run.dq)?, down(&run.dk)?, down(&run.dv)?];
    let scale = (case.head_dim as f64).powf(-0.5);
    let (q, k, v, dout) = (widen(&host.q), widen(&host.k), widen(&host.v), widen(&host.dout));
    let (out, lse) = attention_forward(&ranges, shape, &q, &k, &v, scale)?;
    let (dq, dk, dv) = attention_backward(&ranges, shape, &q, &k, &v, &out, &lse, &dout, scale)?;
    let mut worst = [out, dq, dk, dv].iter().zip(&got).map(|(want, got)| rel_error(got, want)).collect::<Vec<_>>();
    if ranges.num_queries * ranges.num_keys * case.num_heads <= DENSE_REFERENCE_LIMIT {
        let dense = dense_reference(case, &ranges, shape, [&q, &k, &v, &dout])?;
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
    ranges: &KeyRanges,
    shape: AttnShape,
    [q, k, v, dout]: [&Vec<f64>; 4],
) -> Result<[Vec<f64>; 4]> {
    use candle_core::{Device, Tensor, Var};
    let mask = match case.block_layout()? {
        Some(layout) => layout.dense(case.kind),
        None => dflash_reference::mask::causal_dense(case.kind, ranges.num_queries),
    };
    let (nq, nk, d) = (ranges.num_queries, ranges.num_keys, shape.head_dim);
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
