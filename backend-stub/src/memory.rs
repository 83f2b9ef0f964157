//! [`DeviceMemory`] for the stub: real `wgpu::Buffer`s where a device exists.
//!
//! `alloc_buffer` creates a `STORAGE | COPY_SRC | COPY_DST` buffer (rounded up to wgpu's 4-byte
//! copy alignment); `write_buffer` goes through `Queue::write_buffer` and `read_buffer` through a
//! `MAP_READ` staging buffer, both synchronous (submit, then wait for the device). Unaligned
//! offsets and lengths are handled by read-modify-write of the enclosing 4-byte words. Every wgpu
//! call runs inside an error scope, so a wgpu validation or out-of-memory error becomes an
//! [`OpError`], never a panic. Without a device, every method except `synchronize` returns a
//! capability error (`synchronize` has nothing to wait for and succeeds).

use crate::adapter::Gpu;
use crate::backend::StubBackend;
use kvstream_memory_contracts::backend::DeviceBuffer;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::transfer::{check_range, DeviceMemory};

/// wgpu's copy alignment (`wgpu::COPY_BUFFER_ALIGNMENT`) as usize.
const ALIGN: usize = wgpu::COPY_BUFFER_ALIGNMENT as usize;

/// A real wgpu buffer of `len` usable bytes (the allocation may be up to 3 bytes larger).
#[derive(Debug)]
pub struct StubBuffer {
    buffer: wgpu::Buffer,
    len: usize,
}

impl DeviceBuffer for StubBuffer {
    fn len(&self) -> usize {
        self.len
    }
}

impl StubBuffer {
    /// The underlying wgpu buffer (for a port that adds kernels on top of the stub).
    pub fn wgpu_buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}

fn device_err(op: &'static str, e: impl std::fmt::Display) -> OpError {
    OpError::Device {
        op,
        detail: e.to_string(),
    }
}

/// Runs `f` inside validation and out-of-memory error scopes and reports what they caught.
fn scoped<T>(
    gpu: &Gpu,
    op: &'static str,
    bytes: usize,
    f: impl FnOnce() -> T,
) -> Result<T, OpError> {
    let oom = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let validation = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let out = f();
    // Scopes pop innermost first.
    let v = pollster::block_on(validation.pop());
    let o = pollster::block_on(oom.pop());
    if let Some(e) = o {
        tracing::warn!(op, error = %e, "wgpu out of memory");
        return Err(OpError::OutOfMemory {
            what: format!("wgpu `{op}`"),
            bytes,
        });
    }
    if let Some(e) = v {
        return Err(device_err(op, e));
    }
    Ok(out)
}

/// Waits for every submission so far.
fn wait_idle(gpu: &Gpu, op: &'static str) -> Result<(), OpError> {
    gpu.device
        .poll(wgpu::PollType::wait_indefinitely())
        .map(|_| ())
        .map_err(|e| device_err(op, e))
}

/// The 4-byte-aligned byte range enclosing `[offset, offset + len)`.
fn aligned(offset: usize, len: usize) -> (usize, usize) {
    let start = offset - offset % ALIGN;
    let end = (offset + len).next_multiple_of(ALIGN);
    (start, end)
}

impl StubBackend {
    /// Copies `[start, end)` (4-byte aligned) of `buf` into a fresh Vec through a staging buffer.
    fn read_aligned(
        &self,
        gpu: &Gpu,
        buf: &StubBuffer,
        start: usize,
        end: usize,
    ) -> Result<Vec<u8>, OpError> {
        let len = end - start;
        let staging = scoped(gpu, "read_buffer", len, || {
            let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kvstream-stub readback"),
                size: len as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("kvstream-stub readback"),
                });
            enc.copy_buffer_to_buffer(&buf.buffer, start as u64, &staging, 0, len as u64);
            gpu.queue.submit([enc.finish()]);
            staging
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            // The receiver outlives the poll below; a send error only means it was dropped.
            let _ = tx.send(r);
        });
        wait_idle(gpu, "read_buffer")?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(device_err("read_buffer", e)),
            Err(_) => {
                return Err(device_err(
                    "read_buffer",
                    "map callback did not run after waiting for the device",
                ))
            }
        }
        let out = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| device_err("read_buffer", e))?;
            view.to_vec()
        };
        staging.unmap();
        Ok(out)
    }
}

impl DeviceMemory for StubBackend {
    /// A real wgpu buffer of `bytes` bytes (zeroed by wgpu). [`OpError::OutOfMemory`] above the
    /// adapter's `max_buffer_size` or when wgpu runs out of memory; a capability error (operation
    /// `alloc_buffer`) without an adapter.
    fn alloc_buffer(&self, bytes: usize) -> Result<StubBuffer, OpError> {
        let gpu = self.gpu("alloc_buffer")?;
        let _span = tracing::debug_span!("wgpu_alloc_buffer", bytes).entered();
        let size = bytes
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .and_then(|s| u64::try_from(s).ok())
            .filter(|s| *s <= gpu.max_buffer_size);
        let Some(size) = size else {
            return Err(OpError::OutOfMemory {
                what: format!(
                    "wgpu buffer (adapter max_buffer_size is {} bytes)",
                    gpu.max_buffer_size
                ),
                bytes,
            });
        };
        let buffer = scoped(gpu, "alloc_buffer", bytes, || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kvstream-stub arena"),
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        Ok(StubBuffer { buffer, len: bytes })
    }

    /// Writes `data` at `offset` and waits until the write has landed on the device.
    fn write_buffer(&self, buf: &StubBuffer, offset: usize, data: &[u8]) -> Result<(), OpError> {
        let gpu = self.gpu("write_buffer")?;
        check_range("device buffer", offset, data.len(), buf.len)?;
        if data.is_empty() {
            return Ok(());
        }
        let _span = tracing::debug_span!("wgpu_write_buffer", offset, len = data.len()).entered();
        let (start, end) = aligned(offset, data.len());
        let mut words = vec![0u8; end - start];
        if start != offset {
            let head = self.read_aligned(gpu, buf, start, start + ALIGN)?;
            words[..ALIGN].copy_from_slice(&head);
        }
        if end != offset + data.len() {
            let tail = self.read_aligned(gpu, buf, end - ALIGN, end)?;
            let n = words.len();
            words[n - ALIGN..].copy_from_slice(&tail);
        }
        words[offset - start..offset - start + data.len()].copy_from_slice(data);
        scoped(gpu, "write_buffer", words.len(), || {
            gpu.queue.write_buffer(&buf.buffer, start as u64, &words);
            gpu.queue.submit([]);
        })?;
        wait_idle(gpu, "write_buffer")
    }

    /// Reads `out.len()` bytes at `offset` after all queued work has finished.
    fn read_buffer(&self, buf: &StubBuffer, offset: usize, out: &mut [u8]) -> Result<(), OpError> {
        let gpu = self.gpu("read_buffer")?;
        check_range("device buffer", offset, out.len(), buf.len)?;
        if out.is_empty() {
            return Ok(());
        }
        let _span = tracing::debug_span!("wgpu_read_buffer", offset, len = out.len()).entered();
        let (start, end) = aligned(offset, out.len());
        let words = self.read_aligned(gpu, buf, start, end)?;
        out.copy_from_slice(&words[offset - start..offset - start + out.len()]);
        Ok(())
    }

    /// Waits for all submitted wgpu work; without a device there is none, so it succeeds.
    fn synchronize(&self) -> Result<(), OpError> {
        match &self.gpu {
            Some(gpu) => wait_idle(gpu, "synchronize"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::aligned;

    #[test]
    fn aligned_range_encloses_the_request() {
        for offset in 0..13 {
            for len in 1..13 {
                let (s, e) = aligned(offset, len);
                assert!(s <= offset && offset + len <= e);
                assert_eq!(s % 4, 0);
                assert_eq!(e % 4, 0);
                assert!(offset - s < 4 && e - (offset + len) < 4);
            }
        }
    }
}
