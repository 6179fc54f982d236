//! Dense matmuls in row-major terms, `c [m, n] = op(a) [m, k] @ op(b) [k, n] + beta * c` with fp32
//! (or f64) accumulation: cuBLAS on the GPU ([`cuda`]) and its CPU twin ([`twin`]).

pub mod cuda;
pub mod twin;

/// A bf16 row-major matrix operand at a device address: stored `[rows, cols]`, used as is or
/// transposed (`t`).
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub t: bool,
}

impl Mat {
    /// `[rows, cols]` used as is.
    pub fn n(ptr: u64, rows: usize, cols: usize) -> Self {
        Mat { ptr, rows, cols, t: false }
    }

    /// `[rows, cols]` used transposed, as `[cols, rows]`.
    pub fn t(ptr: u64, rows: usize, cols: usize) -> Self {
        Mat { ptr, rows, cols, t: true }
    }

    /// The shape of the operand as used.
    pub fn used(&self) -> (usize, usize) {
        if self.t {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}
