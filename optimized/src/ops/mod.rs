//! The step's operations, each with its API and shapes (`mod.rs`), its CPU twin (`twin.rs`, what
//! CI runs and what the kernels are checked against), its CUDA launcher (`cuda.rs`) and its
//! kernel source (`*.cu`) side by side: [`attention`] (the fused block-sparse attention),
//! [`elementwise`] (norms, RoPE, SwiGLU, CE gradient, copies, reductions, AdamW, random fill) and
//! [`matmul`] (cuBLAS and its twin). [`constants`] are shared by Rust and CUDA; [`sources`]
//! embeds the kernels and hashes them for the attestation.

pub mod attention;
pub mod constants;
pub mod elementwise;
pub mod gdn;
pub mod matmul;
pub mod sources;

use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// The arithmetic type of the CPU twins: f32 (the GPU's fp32 accumulation) or f64 (the twins
/// against the reference at 1e-10).
pub trait Real:
    Copy
    + Default
    + PartialOrd
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// Bytes of one value.
    const BYTES: usize;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const BYTES: usize = std::mem::size_of::<$t>();
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// What a backend stores weights, activations and step gradients in (bf16 on the GPU; bf16, f32
/// or f64 on the CPU), and the arithmetic type its ops compute and keep side values in (fp32
/// for bf16 and f32 storage, f64 for f64).
pub trait Elem: Copy + Default + Send + Sync + 'static {
    const BYTES: usize;
    type Acc: Real;
    fn from_acc(x: Self::Acc) -> Self;
    fn to_acc(self) -> Self::Acc;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Elem for half::bf16 {
    const BYTES: usize = 2;
    type Acc = f32;
    fn from_acc(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_acc(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
}

macro_rules! impl_elem_float {
    ($t:ty) => {
        impl Elem for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            type Acc = $t;
            fn from_acc(x: $t) -> Self {
                x
            }
            fn to_acc(self) -> $t {
                self
            }
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_elem_float!(f32);
impl_elem_float!(f64);

/// `f` of `t`'s values as stored values `E` ([`stored`]), borrowed from `t` without a copy when
/// it already holds them contiguously as `E` (a bf16 tensor for bf16 storage, an f32 one for
/// f32: a row's features uploaded per step, 126 MB at S=3072 for the Qwen3-8B drafter).
pub fn with_stored<E: Elem, R>(t: &candle_core::Tensor, f: impl FnOnce(&[E]) -> crate::Result<R>) -> crate::Result<R> {
    use candle_core::{CpuStorage, Storage};
    use std::any::TypeId;
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(cpu), Some((from, to))) = (&*storage, layout.contiguous_offsets()) {
        // The values' address and count when their type is E's.
        let held = match cpu {
            CpuStorage::BF16(v) if TypeId::of::<E>() == TypeId::of::<half::bf16>() => Some(v[from..to].as_ptr().cast()),
            CpuStorage::F32(v) if TypeId::of::<E>() == TypeId::of::<f32>() => Some(v[from..to].as_ptr().cast()),
            _ => None,
        };
        if let Some(ptr) = held {
            // SAFETY: `ptr` points at `to - from` values of E's own type (checked by TypeId),
            // borrowed from `storage`, which outlives the call.
            return f(unsafe { std::slice::from_raw_parts::<E>(ptr, to - from) });
        }
    }
    drop(storage);
    f(&stored::<E>(t)?)
}

/// `t`'s values as stored values `E`: a bf16 tensor into bf16 storage is taken as it is (no
/// rounding, no detour through f64); otherwise each value through f64.
pub fn stored<E: Elem>(t: &candle_core::Tensor) -> crate::Result<Vec<E>> {
    let t = t.flatten_all()?;
    if t.dtype() == candle_core::DType::BF16 {
        let values = t.to_vec1::<half::bf16>()?;
        if std::any::TypeId::of::<E>() == std::any::TypeId::of::<half::bf16>() {
            let mut values = std::mem::ManuallyDrop::new(values);
            // SAFETY: E is half::bf16 (checked above): the same type, length and capacity.
            return Ok(unsafe { Vec::from_raw_parts(values.as_mut_ptr() as *mut E, values.len(), values.capacity()) });
        }
        return Ok(values.into_iter().map(|x| E::from_f64(x.to_f64())).collect());
    }
    Ok(t.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?.into_iter().map(E::from_f64).collect())
}

/// Plain-old-data values viewed as their bytes.
pub fn bytes_of<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: plain-old-data values viewed as their bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
}

/// Plain-old-data values viewed as their bytes, to be written (a readback's destination).
pub fn bytes_of_mut<T: Copy>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: plain-old-data values viewed as their bytes; every byte pattern is a value of the
    // integer and float types this is used with.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, std::mem::size_of_val(values)) }
}

/// `t`'s values in the arithmetic type of `E` (side values: RoPE tables).
pub fn arithmetic<E: Elem>(t: candle_core::Tensor) -> crate::Result<Vec<E::Acc>> {
    Ok(t.flatten_all()?
        .to_dtype(candle_core::DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(E::Acc::from_f64)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use rand::{Rng, SeedableRng};

    /// Borrowed or converted, the values are [`stored`]'s: contiguous bf16 and f32 tensors (at an
    /// offset, narrowed), non-contiguous ones (transposed), and a dtype other than the storage's.
    #[test]
    fn with_stored_gives_the_stored_values() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let (r, c) = (rng.random_range(2..40), rng.random_range(2..40));
        let values: Vec<f32> = (0..r * c).map(|_| rng.random_range(-4.0..4.0)).collect();
        let f32s = Tensor::from_vec(values, (r, c), &Device::Cpu).unwrap();
        let bf16s = f32s.to_dtype(DType::BF16).unwrap();
        for base in [f32s, bf16s] {
            for t in [base.clone(), base.narrow(0, 1, r - 1).unwrap(), base.t().unwrap()] {
                let got: Vec<half::bf16> = with_stored(&t, |v: &[half::bf16]| Ok(v.to_vec())).unwrap();
                assert_eq!(got, stored::<half::bf16>(&t).unwrap(), "bf16 of {:?} {:?}", t.dtype(), t.dims());
                let got: Vec<f32> = with_stored(&t, |v: &[f32]| Ok(v.to_vec())).unwrap();
                assert_eq!(got, stored::<f32>(&t).unwrap(), "f32 of {:?} {:?}", t.dtype(), t.dims());
            }
        }
    }
}
