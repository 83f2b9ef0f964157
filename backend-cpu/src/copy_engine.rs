//! The CPU copy engine: one worker thread executes copies in FIFO order (the copy "queue"), with
//! real fences.
//!
//! * A copy first waits for every fence in its `wait_for` (a *consumed* or *producer* fence),
//!   then copies, then completes its own fence (the *ready* fence of a ring fill). Because the
//!   queue is in order, a copy blocked on a fence also holds back the copies queued after it,
//!   exactly like a CUDA stream waiting on an event.
//! * A copy fails (its fence completes with an error and **no byte is written**) when a fence it
//!   waited for failed, when an injected failure is pending ([`CpuBackend::inject_copy_failures`])
//!   or when the engine shuts down before its wait ends.
//! * The CPU compute queue is synchronous: [`CopyEngine::record_compute_fence`] returns a
//!   completed fence and [`CopyEngine::compute_wait`] blocks the caller.
//! * Dropping the backend shuts the worker down and joins it; copies still blocked on pending
//!   fences then fail instead of hanging the drop.

use crate::{CpuBackend, CpuBuffer, CpuFence};
use kvstream_memory_contracts::error::TransferError;
use kvstream_memory_contracts::host::{HostBytes, HostRange};
use kvstream_memory_contracts::transfer::{check_range, CopyEngine};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often a copy blocked on a fence re-checks for shutdown.
const SHUTDOWN_POLL: Duration = Duration::from_millis(20);

/// One queued copy between two host allocations.
#[derive(Debug)]
struct Job {
    direction: &'static str,
    src: Arc<HostBytes>,
    src_offset: usize,
    dst: Arc<HostBytes>,
    dst_offset: usize,
    len: usize,
    wait_for: Vec<CpuFence>,
    done: CpuFence,
}

/// Knobs and flags shared with the worker.
#[derive(Debug, Default)]
struct Shared {
    /// The next this-many copies fail (fault injection for tests).
    fail_next: AtomicUsize,
    /// Artificial delay before each copy, in microseconds (tests proving ordering).
    delay_us: AtomicU64,
    /// Set when the backend is dropped.
    shutdown: AtomicBool,
    /// Copies executed successfully (tests).
    completed: AtomicU64,
}

/// The copy queue: a channel into a worker thread.
#[derive(Debug)]
pub(crate) struct CopyWorker {
    tx: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    /// Fence of the last enqueued copy; FIFO makes it complete after every earlier one.
    last: Mutex<CpuFence>,
}

impl CopyWorker {
    /// Starts the worker thread. If the thread cannot be spawned, every copy reports
    /// [`TransferError::ShutDown`].
    pub(crate) fn start() -> Self {
        let (tx, rx) = channel::<Job>();
        let shared = Arc::new(Shared::default());
        let worker_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("kvstream-cpu-copy".into())
            .spawn(move || worker(rx, worker_shared));
        let (tx, handle) = match handle {
            Ok(h) => (Some(tx), Some(h)),
            Err(e) => {
                tracing::error!(error = %e, "cannot spawn the CPU copy worker");
                (None, None)
            }
        };
        Self {
            tx,
            handle,
            shared,
            last: Mutex::new(CpuFence::completed()),
        }
    }

    fn enqueue(&self, job: Job) -> Result<CpuFence, TransferError> {
        let done = job.done.clone();
        let tx = self.tx.as_ref().ok_or(TransferError::ShutDown)?;
        // Hold `last` while sending so that `last` is always the newest queued copy.
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        tx.send(job).map_err(|_| TransferError::ShutDown)?;
        *last = done.clone();
        Ok(done)
    }

    /// Blocks until every copy enqueued so far has completed (with or without error).
    pub(crate) fn drain(&self) {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // The outcome is reported through the copy's own fence.
        let _ = last.wait();
    }
}

impl Drop for CopyWorker {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        drop(self.tx.take());
        if let Some(h) = self.handle.take() {
            if h.join().is_err() {
                tracing::error!("the CPU copy worker panicked");
            }
        }
    }
}

fn worker(rx: Receiver<Job>, shared: Arc<Shared>) {
    while let Ok(job) = rx.recv() {
        let result = run(&job, &shared);
        if let Err(e) = &result {
            tracing::debug!(direction = job.direction, error = %e, "copy failed");
        }
        job.done.signal(result);
    }
}

fn run(job: &Job, shared: &Shared) -> Result<(), String> {
    let _span =
        tracing::trace_span!("cpu_copy", direction = job.direction, len = job.len).entered();
    for f in &job.wait_for {
        loop {
            match f.wait_timeout(SHUTDOWN_POLL) {
                Some(Ok(())) => break,
                Some(Err(e)) => return Err(format!("a fence this copy waited for failed: {e}")),
                None if shared.shutdown.load(Ordering::SeqCst) => {
                    return Err("copy engine shut down while the copy waited".into())
                }
                None => {}
            }
        }
    }
    let delay = shared.delay_us.load(Ordering::SeqCst);
    if delay > 0 && !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_micros(delay));
    }
    let injected = shared
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if injected {
        return Err(format!(
            "injected {} failure of {} bytes",
            job.direction, job.len
        ));
    }
    // SAFETY: both ranges were checked against the allocations' (immutable) lengths when the job
    // was enqueued, and the Arcs keep both allocations alive. `ptr::copy` tolerates overlap
    // (source and destination may be the same allocation). Concurrent access to these bytes by
    // other parties is excluded by the fence protocol, the same contract device memory has.
    unsafe {
        std::ptr::copy(
            job.src.as_ptr().add(job.src_offset),
            job.dst.as_ptr().add(job.dst_offset),
            job.len,
        );
    }
    shared.completed.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

impl CpuBackend {
    /// Fault injection for tests: the next `n` copies fail, completing their fences with an
    /// error without touching memory.
    pub fn inject_copy_failures(&self, n: usize) {
        self.copies.shared.fail_next.store(n, Ordering::SeqCst);
    }

    /// Test knob: every copy sleeps `delay` before moving bytes (to prove that waiters wait).
    pub fn set_copy_delay(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.copies.shared.delay_us.store(us, Ordering::SeqCst);
    }

    /// Copies the worker has completed successfully so far.
    pub fn completed_copies(&self) -> u64 {
        self.copies.shared.completed.load(Ordering::SeqCst)
    }
}

fn fence_result(fence: &CpuFence) -> Result<(), TransferError> {
    fence.wait().map_err(TransferError::CopyFailed)
}

impl CopyEngine for CpuBackend {
    fn copy_h2d(
        &self,
        src: &HostRange,
        dst: &CpuBuffer,
        dst_offset: usize,
        wait_for: &[CpuFence],
    ) -> Result<CpuFence, TransferError> {
        check_range("host range", src.offset, src.len, src.bytes.len())?;
        check_range("device buffer", dst_offset, src.len, dst.0.len())?;
        self.copies.enqueue(Job {
            direction: "h2d",
            src: Arc::clone(&src.bytes),
            src_offset: src.offset,
            dst: Arc::clone(&dst.0),
            dst_offset,
            len: src.len,
            wait_for: wait_for.to_vec(),
            done: CpuFence::pending(),
        })
    }

    fn copy_d2h(
        &self,
        src: &CpuBuffer,
        src_offset: usize,
        dst: &HostRange,
        wait_for: &[CpuFence],
    ) -> Result<CpuFence, TransferError> {
        check_range("host range", dst.offset, dst.len, dst.bytes.len())?;
        check_range("device buffer", src_offset, dst.len, src.0.len())?;
        self.copies.enqueue(Job {
            direction: "d2h",
            src: Arc::clone(&src.0),
            src_offset,
            dst: Arc::clone(&dst.bytes),
            dst_offset: dst.offset,
            len: dst.len,
            wait_for: wait_for.to_vec(),
            done: CpuFence::pending(),
        })
    }

    /// CPU compute runs synchronously on the caller, so everything enqueued has finished.
    fn record_compute_fence(&self) -> Result<CpuFence, TransferError> {
        Ok(CpuFence::completed())
    }

    /// Blocks the caller (the CPU compute queue) until `fence` completes.
    fn compute_wait(&self, fence: &CpuFence) -> Result<(), TransferError> {
        let _span = tracing::trace_span!("cpu_compute_wait").entered();
        fence_result(fence)
    }

    fn host_wait(&self, fence: &CpuFence) -> Result<(), TransferError> {
        fence_result(fence)
    }
}
