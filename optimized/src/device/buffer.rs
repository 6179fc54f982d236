//! Device buffers of the GPU step: typed allocations from the memory pool that hand out their
//! raw address, so that one step can pass many buffers (some in place) to kernels and cuBLAS
//! without borrowing them. All work is on the GPU's one stream, which orders every access.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::{Error, Result};
use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

/// `len` values of `T` on the device (from the stream's memory pool), freed on drop.
pub struct Buf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
    name: String,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    /// Allocates `len` zeroed values (at least one) named `name` in errors.
    pub fn zeros(stream: &Arc<CudaStream>, name: &str, len: usize) -> Result<Self> {
        let slice = stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| Error::Gpu(format!("allocating `{name}` ({len} x {} bytes): {e}", size_of::<T>())))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(Buf { slice, ptr, name: name.to_string(), _t: PhantomData })
    }

    /// Allocates and fills from `host`.
    pub fn from_host(stream: &Arc<CudaStream>, name: &str, host: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(stream, name, host.len())?;
        buf.upload(stream, host)?;
        Ok(buf)
    }

    /// Copies `host` to the start of the buffer.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, host: &[T]) -> Result<()> {
        if host.len() > self.len() {
            return Err(Error::invalid(&self.name, format!("{} values for a buffer of {}", host.len(), self.len())));
        }
        stream.memcpy_htod(host, &mut self.slice.slice_mut(..host.len())).map_err(|e| self.err("upload", e))
    }

    /// Copies the buffer to the host (waits for the stream).
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<Vec<T>> {
        stream.clone_dtoh(&self.slice).map_err(|e| self.err("download", e))
    }
}

impl<T> Buf<T> {
    /// The device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.ptr + (i * size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::Gpu(format!("{what} `{}`: {e}", self.name))
    }
}

/// Copies `len` values of `T` from device address `src` to `dst` on `stream`.
pub fn copy_device<T>(stream: &Arc<CudaStream>, dst: u64, src: u64, len: usize) -> Result<()> {
    // SAFETY: callers pass addresses of live buffers holding `len` values; the stream orders it.
    unsafe { result::memcpy_dtod_async(dst, src, len * size_of::<T>(), stream.cu_stream()) }
        .map_err(|e| Error::Gpu(format!("device copy of {len} values: {e}")))
}

/// Sets `bytes` bytes at device address `ptr` to zero on `stream`.
pub fn zero_device(stream: &Arc<CudaStream>, ptr: u64, bytes: usize) -> Result<()> {
    // SAFETY: callers pass a live buffer's address and size; the stream orders it.
    unsafe { result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }
        .map_err(|e| Error::Gpu(format!("zeroing {bytes} bytes: {e}")))
}

/// `len` values of `T` from device address `ptr` (waits for the stream).
pub fn download_device<T: Copy + Default>(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Result<Vec<T>> {
    let mut host = vec![T::default(); len];
    // SAFETY: callers pass a live buffer holding `len` values; the copy completes before return.
    unsafe { result::memcpy_dtoh_async(&mut host, ptr, stream.cu_stream()) }
        .and_then(|()| stream.synchronize())
        .map_err(|e| Error::Gpu(format!("download of {len} values: {e}")))?;
    Ok(host)
}
