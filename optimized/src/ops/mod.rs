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

/// `t`'s values in the arithmetic type of `E` (side values: RoPE tables).
pub fn arithmetic<E: Elem>(t: candle_core::Tensor) -> crate::Result<Vec<E::Acc>> {
    Ok(t.flatten_all()?
        .to_dtype(candle_core::DType::F64)?
        .to_vec1::<f64>()?
        .into_iter()
        .map(E::Acc::from_f64)
        .collect())
}
