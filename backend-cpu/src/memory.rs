//! `DeviceMemory` for the CPU backend: "device" buffers are zeroed, page-aligned host
//! allocations ([`HostBytes`]); synchronous access first drains the copy queue.

use crate::{CpuBackend, CpuBuffer};
use kvstream_memory_contracts::error::{HostError, OpError};
use kvstream_memory_contracts::host::HostBytes;
use kvstream_memory_contracts::transfer::{check_range, DeviceMemory};
use std::sync::Arc;

impl DeviceMemory for CpuBackend {
    /// A zeroed allocation of `bytes` bytes ([`OpError::OutOfMemory`] if the host refuses).
    fn alloc_buffer(&self, bytes: usize) -> Result<CpuBuffer, OpError> {
        let mem = HostBytes::new(bytes).map_err(|e| match e {
            HostError::Alloc { bytes, .. } => OpError::OutOfMemory {
                what: "cpu device buffer".into(),
                bytes,
            },
            other => OpError::Device {
                op: "alloc_buffer",
                detail: other.to_string(),
            },
        })?;
        Ok(CpuBuffer(Arc::new(mem)))
    }

    /// Waits for queued copies, then writes `data` at `offset` (range-checked).
    fn write_buffer(&self, buf: &CpuBuffer, offset: usize, data: &[u8]) -> Result<(), OpError> {
        check_range("device buffer", offset, data.len(), buf.0.len())?;
        self.synchronize()?;
        buf.0.write(offset, data).map_err(|e| OpError::Device {
            op: "write_buffer",
            detail: e.to_string(),
        })
    }

    /// Waits for queued copies, then reads `out.len()` bytes at `offset` (range-checked).
    fn read_buffer(&self, buf: &CpuBuffer, offset: usize, out: &mut [u8]) -> Result<(), OpError> {
        check_range("device buffer", offset, out.len(), buf.0.len())?;
        self.synchronize()?;
        buf.0.read(offset, out).map_err(|e| OpError::Device {
            op: "read_buffer",
            detail: e.to_string(),
        })
    }

    /// Compute is synchronous on the CPU; waits until every copy enqueued so far has completed
    /// (successfully or not: a failed copy reports through its own fence).
    fn synchronize(&self) -> Result<(), OpError> {
        self.copies.drain();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::error::TransferError;

    #[test]
    fn buffers_are_zeroed_and_round_trip() {
        let b = CpuBackend::new();
        let buf = b.alloc_buffer(10_000).expect("alloc");
        let mut out = vec![1u8; 10_000];
        b.read_buffer(&buf, 0, &mut out).expect("read");
        assert!(out.iter().all(|&x| x == 0));
        let data: Vec<u8> = (0..777u32).map(|i| (i * 31 % 251) as u8 + 1).collect();
        b.write_buffer(&buf, 9_000, &data).expect("write");
        let mut back = vec![0u8; 777];
        b.read_buffer(&buf, 9_000, &mut back).expect("read");
        assert_eq!(back, data);
    }

    #[test]
    fn out_of_range_access_is_a_typed_error() {
        let b = CpuBackend::new();
        let buf = b.alloc_buffer(100).expect("alloc");
        assert!(matches!(
            b.write_buffer(&buf, 90, &[1; 11]),
            Err(OpError::Transfer(TransferError::OutOfRange { .. }))
        ));
        let mut out = [0u8; 8];
        assert!(matches!(
            b.read_buffer(&buf, usize::MAX - 2, &mut out),
            Err(OpError::Transfer(TransferError::OutOfRange { .. }))
        ));
    }
}
