//! The persistent tensor-core q4_g128 decode GEMV (`gemv_q4mmap*` in `kernels/src/cu/gemv_mma.cu`):
//! the fragments and precision of [`super::q4mma`], arranged so every warp streams its (m-tile,
//! 128-group) items through a register ring without pause. A grid of `SMs × blocks per SM` blocks
//! of 8 warps; the warps form teams of `S` (1, 2, 4 or 8) that take every `teams`-th 16-row tile,
//! member `m` the groups `G ≡ m (mod S)` of each; the members' sums are added in member order.
//!
//! Bit-identity across T (MTP verification rows must equal single steps): the team size is a
//! function of N, K and the SM count only; the grid, the x staging (`_xs`: x fragments in shared
//! memory when they fit) and T only decide who computes a tile and where x is read from, never
//! the arithmetic of an output.

use crate::launch::args;
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::{sys, CudaFunction, LaunchConfig};
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::Ordering;

/// Warps per block (`QM_WARPS` in gemv_mma.cu).
const WARPS: usize = 8;
/// Values per scale group and per work item.
const GROUP: usize = 128;
/// Environment switch: `3` runs the 3-blocks-per-SM build (`gemv_q4mmap3*`: 2-stage ring, 80
/// registers) instead of the 2-blocks-per-SM one (4-stage ring, 128 registers).
pub const MMAP_OCC_ENV: &str = "KVSTREAM_Q4_MMAP_OCC";

/// Blocks per SM of the build in use (`__launch_bounds__(256, 2)` or `(256, 3)`).
fn blocks_per_sm() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        if std::env::var(MMAP_OCC_ENV).is_ok_and(|v| v.trim() == "3") {
            3
        } else {
            2
        }
    })
}
/// Shared memory of one SM on Hopper (the x staging is sized so two blocks fit).
const SM_SHARED_BYTES: usize = 228 * 1024;
/// Static shared memory of the kernels (the double-buffered team sums) plus the driver's
/// per-block reservation.
const STATIC_SHARED_BYTES: usize = 8 * 1024 + 1024;

/// One launch of the persistent kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Q4MmapPlan {
    /// Warps per team (splitting each tile's groups).
    pub(crate) team: usize,
    /// Blocks of the grid.
    pub(crate) blocks: u32,
}

/// The plan for `[n, k]` q4_g128 codes at `w_ptr` (scales at byte `soff`) on `sms`
/// multiprocessors, or `None` when the shape does not suit the kernel (K not a multiple of 128,
/// unaligned codes or scales, too many rows). The team size minimises the items of the busiest
/// warp, `ceil(tiles / teams) · (ceil(groups / S) + 1)` (the `+ 1` charges a tile's reduction),
/// over a grid of `sms · per_sm` blocks (fewer when the tiles need fewer); ties take the smaller
/// team.
pub(crate) fn q4_mmap_plan(
    n: usize,
    k: usize,
    w_ptr: u64,
    soff: u64,
    sms: usize,
    per_sm: usize,
) -> Option<Q4MmapPlan> {
    if n == 0 || k == 0 || k % GROUP != 0 || w_ptr % 16 != 0 || soff % 2 != 0 {
        return None;
    }
    if n > u32::MAX as usize / 2 {
        return None;
    }
    let groups = k / GROUP;
    let tiles = n.div_ceil(16);
    let capacity = sms.max(1) * per_sm.max(1);
    let mut best: Option<(usize, Q4MmapPlan)> = None;
    for team in [1usize, 2, 4, 8] {
        if team > groups {
            break;
        }
        let per_block = WARPS / team;
        let blocks = tiles.div_ceil(per_block).min(capacity);
        let teams = blocks * per_block;
        let cost = tiles.div_ceil(teams) * (groups.div_ceil(team) + 1);
        if best.is_none_or(|(c, _)| cost < c) {
            let blocks = u32::try_from(blocks).ok()?;
            best = Some((cost, Q4MmapPlan { team, blocks }));
        }
    }
    best.map(|(_, p)| p)
}

/// Most dynamic shared memory `_xs` takes: `per_sm` blocks per SM still fit.
fn staged_limit(max_smem_optin: usize, per_sm: usize) -> usize {
    (SM_SHARED_BYTES / per_sm.max(1))
        .saturating_sub(STATIC_SHARED_BYTES)
        .min(max_smem_optin.saturating_sub(STATIC_SHARED_BYTES))
}

/// Bytes of x fragments `_xs` stages in shared memory for `t` tokens of `k` values (4 bytes per
/// value and one 16-byte pad per token), when `per_sm` blocks per SM still fit (else the plain
/// kernel reads x from global memory).
fn staged_x_bytes(t: usize, k: usize, max_smem_optin: usize, per_sm: usize) -> Option<usize> {
    let bytes = t * (k * 4 + 16);
    (bytes <= staged_limit(max_smem_optin, per_sm)).then_some(bytes)
}

fn allow_dynamic_smem(f: &CudaFunction, bytes: usize) -> Result<(), OpError> {
    // SAFETY: sets a launch attribute of a loaded function to a size the caller checked against
    // the device's opt-in limit.
    let r = unsafe {
        sys::cuFuncSetAttribute(
            f.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(OpError::Capability(
            kvstream_memory_contracts::CapabilityError::new(
                "cuda",
                "gemv_q4mmap_xs",
                format!("cannot reserve {bytes} bytes of shared memory: {r:?}"),
            ),
        ));
    }
    Ok(())
}

impl CudaBackend {
    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` on the tensor cores, persistent kernel (`t` ≤ 8).
    #[allow(clippy::too_many_arguments)]
    /// The plan for a q4_g128 weight on this device (the build in use decides the grid).
    pub(crate) fn q4_mmap_plan(
        &self,
        n: usize,
        k: usize,
        w_ptr: u64,
        soff: u64,
    ) -> Option<Q4MmapPlan> {
        q4_mmap_plan(n, k, w_ptr, soff, self.sm_count, blocks_per_sm())
    }

    pub(crate) fn gemv_q4_mmap(
        &self,
        plan: Q4MmapPlan,
        x: &CudaTensor,
        w_ptr: u64,
        soff: u64,
        y: &CudaTensor,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("gemv_q4_mmap", t, n, k, team = plan.team).entered();
        let xf = self.q4_mma_xprep(x, t, k)?;
        let per_sm = blocks_per_sm();
        let staged = staged_x_bytes(t, k, self.max_smem_optin, per_sm);
        let (name, smem) = match (staged, per_sm) {
            (Some(b), 3) => ("gemv_q4mmap3_xs", b),
            (None, 3) => ("gemv_q4mmap3", 0),
            (Some(b), _) => ("gemv_q4mmap_xs", b),
            (None, _) => ("gemv_q4mmap", 0),
        };
        let f = self.func(name)?;
        // Static + dynamic shared memory beyond 48 KiB needs the opt-in, once for the largest size.
        if smem > 0 && !self.q4_gemv.xs_reserved.load(Ordering::Relaxed) {
            allow_dynamic_smem(f, staged_limit(self.max_smem_optin, per_sm))?;
            self.q4_gemv.xs_reserved.store(true, Ordering::Relaxed);
        }
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks, 1, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (xfp, yp) = (xf.ptr(), y.ptr());
        let (t32, k64, n64, s32) = (t as i32, k as u64, n as u64, plan.team as i32);
        let mut a = args![&xfp, &w_ptr, &yp, &t32, &k64, &n64, &soff, &s32];
        self.launch("gemv", f, cfg, &mut a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_needs_whole_groups_and_aligned_codes() {
        assert!(q4_mmap_plan(64, 1024, 0, 0, 132, 2).is_some());
        assert!(q4_mmap_plan(64, 1000, 0, 0, 132, 2).is_none());
        assert!(q4_mmap_plan(64, 1024, 8, 0, 132, 2).is_none());
        assert!(q4_mmap_plan(64, 1024, 0, 3, 132, 2).is_none());
        assert!(q4_mmap_plan(0, 1024, 0, 0, 132, 2).is_none());
    }

    #[test]
    fn teams_never_outnumber_the_groups_and_the_grid_fits_one_wave() {
        for &(n, k, sms) in &[
            (17408, 5120, 132),
            (5120, 17408, 132),
            (12288, 5120, 132),
            (248_320, 5120, 132),
            (7, 128, 132),
            (70, 256, 0),
            (4096, 384, 1),
        ] {
            for per_sm in [2, 3] {
                let p = q4_mmap_plan(n, k, 0, 0, sms, per_sm).expect("plan");
                assert!(p.team <= k / GROUP, "{n}x{k}: {p:?}");
                assert!(WARPS % p.team == 0);
                let cap = sms.max(1) * per_sm;
                assert!(p.blocks as usize <= cap, "{p:?}");
                // Every tile has a team: blocks · teams per block ≥ tiles, or the grid is full.
                let teams = p.blocks as usize * (WARPS / p.team);
                assert!(teams >= n.div_ceil(16) || p.blocks as usize == cap, "{p:?}");
            }
        }
        // The 27B MLP up/gate: 1,088 tiles of 40 groups on 264 blocks → teams of 8
        // (5 tiles × 6 items) beat teams of 4 (3 × 11) and smaller.
        assert_eq!(
            q4_mmap_plan(17408, 5120, 0, 0, 132, 2).map(|p| p.team),
            Some(8)
        );
        // A single group: no split.
        assert_eq!(
            q4_mmap_plan(4096, 128, 0, 0, 132, 2).map(|p| p.team),
            Some(1)
        );
    }

    #[test]
    fn x_is_staged_only_when_two_blocks_still_fit() {
        let optin = 227 * 1024;
        assert_eq!(staged_x_bytes(1, 5120, optin, 2), Some(20_496));
        assert_eq!(staged_x_bytes(1, 17408, optin, 2), Some(69_648));
        assert_eq!(staged_x_bytes(4, 5120, optin, 2), Some(81_984));
        assert_eq!(staged_x_bytes(8, 5120, optin, 2), None);
        assert_eq!(staged_x_bytes(4, 17408, optin, 2), None);
        assert_eq!(staged_x_bytes(1, 17408, 48 * 1024, 2), None);
        // Three blocks per SM: 66 KiB at most.
        assert_eq!(staged_x_bytes(1, 5120, optin, 3), Some(20_496));
        assert_eq!(staged_x_bytes(1, 17408, optin, 3), None);
        for per_sm in [2, 3] {
            assert!(staged_limit(optin, per_sm) + STATIC_SHARED_BYTES <= SM_SHARED_BYTES / per_sm);
        }
    }
}
