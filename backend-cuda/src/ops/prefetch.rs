//! Weight prefetch into L2 (`LinearOps::prefetch_weight`, opt-in [`L2_PREFETCH_ENV`]).
//!
//! Between a layer's input projection and its output projection, decode runs small
//! latency-bound kernels (the GDN conv and recurrence, the gated norm; in attention layers the
//! q/k norms, RoPE and the KV write) that leave HBM mostly idle, while the output projection
//! (27B q4_g128: 5120×6144, 16 MB) pays several µs per call that are not bandwidth. The model
//! names that weight right after the input projection and the backend asks L2 for its bytes
//! (`l2_prefetch`, elementwise.cu), so the GEMV later reads them from L2. A hint only: results
//! never change, and weights larger than half the L2 are left alone (they would evict
//! themselves).

use crate::launch::args;
use crate::{CudaBackend, CudaWeight};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Environment switch: `1` lets `prefetch_weight` issue L2 prefetches; unset or `0` makes it a
/// no-op (the default until measured on the target GPU).
pub const L2_PREFETCH_ENV: &str = "KVSTREAM_L2_PREFETCH";

/// Bytes one line prefetch covers below sm_90, and that kernel's threads per block.
const LINE_BYTES: usize = 128;
const LINE_THREADS: usize = 256;
/// Most blocks of the line-prefetch grid (each thread loops over further lines).
const LINE_MAX_BLOCKS: usize = 1024;

/// Per-backend state: the switch, the L2 size and a launch counter (tests, benches).
#[derive(Debug)]
pub(crate) struct L2Prefetch {
    enabled: AtomicBool,
    launches: AtomicU64,
    l2_bytes: usize,
}

impl L2Prefetch {
    pub(crate) fn new(l2_bytes: usize) -> Self {
        Self {
            enabled: AtomicBool::new(std::env::var(L2_PREFETCH_ENV).is_ok_and(|v| v.trim() == "1")),
            launches: AtomicU64::new(0),
            l2_bytes,
        }
    }
}

/// The grid and block of the prefetch of `bytes` at `ptr` on a device with `l2_bytes` of L2, or
/// `None` when it is not worth a launch: nothing to fetch, an unaligned start, or more than half
/// the L2.
fn prefetch_launch(bytes: usize, ptr: u64, l2_bytes: usize, bulk: bool) -> Option<(u32, u32)> {
    if bytes < 16 || ptr % 16 != 0 || bytes > l2_bytes / 2 {
        return None;
    }
    if bulk {
        // One warp of 64 KiB requests (the kernel's `chunk`): a 16 MB weight is 256 of them, 8 per lane.
        Some((1, 32))
    } else {
        let blocks = bytes
            .div_ceil(LINE_BYTES * LINE_THREADS)
            .clamp(1, LINE_MAX_BLOCKS);
        Some((u32::try_from(blocks).ok()?, LINE_THREADS as u32))
    }
}

impl CudaBackend {
    /// Whether `prefetch_weight` issues L2 prefetches ([`L2_PREFETCH_ENV`]).
    pub fn l2_prefetch(&self) -> bool {
        self.l2_prefetch.enabled.load(Ordering::Relaxed)
    }

    /// Turns weight prefetches into L2 on or off (overrides `KVSTREAM_L2_PREFETCH`).
    pub fn set_l2_prefetch(&self, on: bool) {
        self.l2_prefetch.enabled.store(on, Ordering::Relaxed);
    }

    /// Prefetch launches issued so far.
    pub fn l2_prefetch_launches(&self) -> u64 {
        self.l2_prefetch.launches.load(Ordering::Relaxed)
    }

    /// `LinearOps::prefetch_weight`: one `l2_prefetch` launch over the weight's bytes when the
    /// switch is on and the weight fits half the L2.
    pub(crate) fn prefetch_weight_l2(&self, w: &CudaWeight) -> Result<(), OpError> {
        if !self.l2_prefetch() {
            return Ok(());
        }
        let bytes = w.alloc.len();
        let Some((grid, block)) = prefetch_launch(
            bytes,
            w.ptr(),
            self.l2_prefetch.l2_bytes,
            self.arch_at_least(90),
        ) else {
            return Ok(());
        };
        let _span = tracing::trace_span!("l2_prefetch", bytes).entered();
        let f = self.func("l2_prefetch")?;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let (p, n) = (w.ptr(), bytes as u64);
        let mut a = args![&p, &n];
        // On sm_90 a programmatic dependent: its requests go out while the kernel before it
        // drains; it waits for that kernel before it exits (elementwise.cu).
        if self.arch_at_least(90) {
            self.launch_dependent("l2_prefetch", f, cfg, &mut a)?;
        } else {
            self.launch("l2_prefetch", f, cfg, &mut a)?;
        }
        self.l2_prefetch.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L2: usize = 50 << 20;

    #[test]
    fn prefetch_takes_aligned_weights_up_to_half_the_l2() {
        // The 27B out projection in q4_g128 (16.2 MB): one warp of bulk requests on sm_90.
        let out = 5120 * 6144 / 2 + 5120 * 48 * 2;
        assert_eq!(prefetch_launch(out, 0, L2, true), Some((1, 32)));
        // Line prefetches below sm_90: enough threads for one line each, capped.
        assert_eq!(prefetch_launch(128 * 256 * 3, 0, L2, false), Some((3, 256)));
        assert_eq!(prefetch_launch(L2 / 2, 0, L2, false), Some((800, 256)));
        assert_eq!(
            prefetch_launch(64 << 20, 0, 256 << 20, false),
            Some((LINE_MAX_BLOCKS as u32, 256))
        );
        // bf16 out projection (63 MB), unaligned, empty: no launch.
        assert_eq!(prefetch_launch(5120 * 6144 * 2, 0, L2, true), None);
        assert_eq!(prefetch_launch(L2 / 2 + 1, 0, L2, true), None);
        assert_eq!(prefetch_launch(out, 8, L2, true), None);
        assert_eq!(prefetch_launch(0, 0, L2, true), None);
        // No L2 reported: nothing.
        assert_eq!(prefetch_launch(4096, 0, 0, true), None);
    }
}
