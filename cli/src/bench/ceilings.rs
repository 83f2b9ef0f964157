//! Measured bandwidth ceilings of a backend, for the roofline.

use super::roofline::Ceilings;
use anyhow::{bail, Result};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::host::{HostRange, PinnedBuffer};
use kvstream_memory_contracts::ops::{ModelBackend, WeightData};
use std::time::Instant;

/// Sizes of the probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeSizes {
    /// Bytes copied host → device per repetition.
    pub h2d_bytes: usize,
    /// Bytes per copy request.
    pub h2d_request: usize,
    /// Bytes of the bf16 weight the device-read probe streams.
    pub read_bytes: usize,
    /// Timed repetitions (the best one counts).
    pub reps: usize,
}

/// Host → device GB/s: `h2d_bytes` of pinned host memory copied in `h2d_request` requests, all
/// issued, then waited with `host_wait` (best of `reps` after a warm-up).
pub fn measure_h2d<B: ModelBackend>(b: &B, s: &ProbeSizes) -> Result<f64> {
    let _span = tracing::info_span!("probe_h2d", bytes = s.h2d_bytes).entered();
    if s.h2d_bytes == 0 || s.h2d_request == 0 {
        bail!("the H2D probe needs a positive size and request size");
    }
    let host = PinnedBuffer::new(b, s.h2d_bytes)?;
    // Non-zero contents: a backend may not skip anything.
    let pattern: Vec<u8> = (0..s.h2d_bytes.min(1 << 20))
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    let mut off = 0;
    while off < s.h2d_bytes {
        let n = pattern.len().min(s.h2d_bytes - off);
        host.bytes().write(off, &pattern[..n])?;
        off += n;
    }
    let dst = b.alloc_buffer(s.h2d_bytes)?;
    let mut best = f64::INFINITY;
    for rep in 0..=s.reps.max(1) {
        let t = Instant::now();
        let mut fences = Vec::new();
        let mut off = 0;
        while off < s.h2d_bytes {
            let len = s.h2d_request.min(s.h2d_bytes - off);
            let src = HostRange {
                bytes: std::sync::Arc::clone(host.bytes()),
                offset: off,
                len,
            };
            fences.push(b.copy_h2d(&src, &dst, off, &[])?);
            off += len;
        }
        for f in &fences {
            b.host_wait(f)?;
        }
        let dt = t.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(dt);
        }
    }
    Ok(s.h2d_bytes as f64 / best / 1e9)
}

/// Device-memory read GB/s: a GEMV (`[1, K] × Wᵀ`) over a bf16 weight of `read_bytes`, counting
/// the weight bytes (best of `reps` after a warm-up).
pub fn measure_device_read<B: ModelBackend>(b: &B, s: &ProbeSizes) -> Result<f64> {
    let _span = tracing::info_span!("probe_device_read", bytes = s.read_bytes).entered();
    const K: usize = 4096;
    let n = (s.read_bytes / (K * 2)).max(1);
    // bf16 0.01 (0x3C24) everywhere: finite, non-zero.
    let bytes: Vec<u8> = std::iter::repeat_n([0x24u8, 0x3C], n * K)
        .flatten()
        .collect();
    let w = b.load_weight(
        "bench.read_probe",
        WeightDType::Bf16,
        &[n, K],
        WeightData::from_vec(bytes),
    )?;
    let x: Vec<f32> = (0..K).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let x = b.tensor_from_f32(&x, &[1, K])?;
    let mut best = f64::INFINITY;
    for rep in 0..=s.reps.max(1) {
        b.synchronize()?;
        let t = Instant::now();
        let y = b.matmul(&x, &w)?;
        b.synchronize()?;
        let dt = t.elapsed().as_secs_f64();
        drop(y);
        if rep > 0 {
            best = best.min(dt);
        }
    }
    Ok((n * K * 2) as f64 / best / 1e9)
}

/// Both ceilings.
pub fn measure<B: ModelBackend>(b: &B, s: &ProbeSizes) -> Result<Ceilings> {
    Ok(Ceilings {
        h2d_gbps: measure_h2d(b, s)?,
        hbm_gbps: measure_device_read(b, s)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ceilings_are_positive_and_finite() {
        let b = kvstream_backend_cpu::CpuBackend::new();
        let s = ProbeSizes {
            h2d_bytes: 4 << 20,
            h2d_request: 1 << 20,
            read_bytes: 8 << 20,
            reps: 2,
        };
        let c = measure(&b, &s).expect("probes");
        assert!(c.h2d_gbps.is_finite() && c.h2d_gbps > 0.0, "{c:?}");
        assert!(c.hbm_gbps.is_finite() && c.hbm_gbps > 0.0, "{c:?}");
        assert!(measure_h2d(&b, &ProbeSizes { h2d_bytes: 0, ..s }).is_err());
    }
}
