//! Per-operation GPU time, for `xtask bench step --profile yes`: while enabled, every kernel
//! launch and matmul of the step is bracketed by CUDA events on its stream, and [`report`] sums
//! each operation's time. Disabled (the default), [`scope`] only runs its closure.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream};

static ENABLED: AtomicBool = AtomicBool::new(false);
static RECORDS: Mutex<Vec<(String, CudaEvent, CudaEvent)>> = Mutex::new(Vec::new());

/// Starts or stops recording.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::SeqCst);
}

/// Runs `f`, which queues one operation on `stream`; while recording, brackets it with events
/// under the name `name()`.
pub fn scope<R>(stream: &CudaStream, name: impl FnOnce() -> String, f: impl FnOnce() -> Result<R>) -> Result<R> {
    if !ENABLED.load(Ordering::Relaxed) {
        return f();
    }
    let event = || {
        stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| Error::Gpu(format!("profiling event: {e}")))
    };
    let start = event()?;
    let out = f()?;
    let end = event()?;
    RECORDS.lock().unwrap_or_else(|p| p.into_inner()).push((name(), start, end));
    Ok(out)
}

/// What [`report`] found: `(name, total ms, count)` per operation, longest total first, and
/// the GPU time from the first operation's start to the last one's end (the operations' sum
/// plus the GPU's idle time between them: launch gaps and waits on the host).
pub struct Report {
    pub ops: Vec<(String, f64, usize)>,
    pub span_ms: f64,
}

/// Every operation recorded since the last report (waits for the recorded work); clears the
/// records.
pub fn report() -> Result<Report> {
    let records = std::mem::take(&mut *RECORDS.lock().unwrap_or_else(|p| p.into_inner()));
    let event_err = |e| Error::Gpu(format!("profiling event: {e}"));
    let mut totals: Vec<(String, f64, usize)> = Vec::new();
    for (name, start, end) in &records {
        end.synchronize().map_err(event_err)?;
        let ms = f64::from(start.elapsed_ms(end).map_err(event_err)?);
        match totals.iter_mut().find(|t| &t.0 == name) {
            Some(t) => {
                t.1 += ms;
                t.2 += 1;
            }
            None => totals.push((name.clone(), ms, 1)),
        }
    }
    totals.sort_by(|a, b| b.1.total_cmp(&a.1));
    let span_ms = match (records.first(), records.last()) {
        (Some(first), Some(last)) => f64::from(first.1.elapsed_ms(&last.2).map_err(event_err)?),
        _ => 0.0,
    };
    Ok(Report { ops: totals, span_ms })
}
