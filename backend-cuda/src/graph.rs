//! CUDA graph capture of work enqueued on the compute stream: [`CudaBackend::capture`] records
//! what a closure enqueues (kernels, stream-ordered allocations and frees, async copies) into a
//! [`CapturedWork`] that replays it with one launch. The micro-benchmark times kernels this way,
//! free of the host's per-launch cost (the GPU timeline only).
//!
//! Capture rules (CUDA's): the closure must not synchronize or read results on the host, and
//! every buffer the work touches must stay allocated while the graph may replay. Buffers the
//! closure frees go back to the allocation cache or the stream-ordered pool and may be handed out
//! again: replay a captured graph only while nothing else uses the backend.

use crate::launch::dev;
use crate::CudaBackend;
use cudarc::driver::{sys, CudaGraph};
use kvstream_memory_contracts::error::OpError;

/// Work recorded from the compute stream, replayable with [`CapturedWork::launch`].
pub struct CapturedWork {
    graph: CudaGraph,
}

impl std::fmt::Debug for CapturedWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedWork").finish_non_exhaustive()
    }
}

impl CapturedWork {
    /// Enqueues one replay on the compute stream (asynchronous).
    pub fn launch(&self) -> Result<(), OpError> {
        self.graph.launch().map_err(dev("graph launch"))
    }
}

impl CudaBackend {
    /// Records what `work` enqueues on the compute stream (relaxed capture mode: this thread may
    /// still make calls CUDA deems unsafe during capture, e.g. first-use allocations). On an error
    /// inside `work` the capture is ended and discarded before the error is returned.
    pub fn capture(
        &self,
        work: impl FnOnce() -> Result<(), OpError>,
    ) -> Result<CapturedWork, OpError> {
        self.compute
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(dev("graph capture"))?;
        let worked = work();
        let ended = self
            .compute
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(dev("graph capture"));
        worked?;
        let graph = ended?.ok_or_else(|| {
            OpError::shape(
                "graph capture",
                "nothing was enqueued on the compute stream",
            )
        })?;
        graph.upload().map_err(dev("graph upload"))?;
        Ok(CapturedWork { graph })
    }
}
