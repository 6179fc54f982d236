//! The CPU twin of the cuBLAS matmul: plain loops over stored values, accumulating in the
//! storage's arithmetic type (fp32 for bf16 and f32, f64 for f64), one rounding to the stored
//! type per output.

use super::Mat;
use crate::ops::elementwise::twin::{ld, st};
use crate::ops::{Elem, Real};
use crate::{Error, Result};

/// `c [m, n] = a @ b + beta * c` on host addresses of values stored as `E`.
pub fn matmul<E: Elem>(a: Mat, b: Mat, c: u64, beta: f32) -> Result<()> {
    let ((m, k), (kb, n)) = (a.used(), b.used());
    if k != kb {
        return Err(Error::invalid("matmul", format!("inner dims differ: a is {m}x{k}, b is {kb}x{n}")));
    }
    let at = |i: usize, x: usize| if a.t { ld::<E>(a.ptr, x * a.cols + i) } else { ld::<E>(a.ptr, i * a.cols + x) };
    let bt = |x: usize, j: usize| if b.t { ld::<E>(b.ptr, j * b.cols + x) } else { ld::<E>(b.ptr, x * b.cols + j) };
    let beta = E::Acc::from_f64(f64::from(beta));
    for i in 0..m {
        for j in 0..n {
            let acc = (0..k).fold(E::Acc::ZERO, |s, x| s + at(i, x) * bt(x, j));
            let old = if beta != E::Acc::ZERO { beta * ld::<E>(c, i * n + j) } else { E::Acc::ZERO };
            st::<E>(c, i * n + j, acc + old);
        }
    }
    Ok(())
}
