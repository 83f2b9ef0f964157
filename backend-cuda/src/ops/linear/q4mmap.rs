//! The persistent stream-K tensor-core q4_g128 decode GEMV (`gemv_q4mmap*` in
//! `kernels/src/cu/gemv_mma.cu`): the fragments and precision of [`super::q4mma`], arranged so
//! every warp streams an equal share of the (16-row tile, 128-group) items through a register ring
//! without pause. A grid of `SMs × blocks per SM` blocks of 8 warps; warp `w` of the `W` takes the
//! items `[w·work/W, (w+1)·work/W)`; a tile shared by several warps is finished by the last to
//! arrive, which adds the partial sums in warp order (scratch slots and per-tile counters in the
//! backend's [`super::streamk`] holder, counters zero between launches).
//!
//! Bit-identity across T (MTP verification rows must equal single steps): the grid is a function
//! of the SM count and the build only; T and the x staging (`_xs`: x fragments in shared memory
//! when they fit) only decide where x is read from, never the arithmetic of an output.

use crate::launch::args;
use crate::{CudaBackend, CudaTensor, DeviceAlloc};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use std::sync::Arc;

/// Warps per block (`QM_WARPS` in gemv_mma.cu).
const WARPS: usize = 8;
/// Values per scale group and per work item.
const GROUP: usize = 128;
/// Environment switch: `3` runs the 3-blocks-per-SM build (`gemv_q4mmap3*`: 2-stage ring, 80
/// registers) instead of the 2-blocks-per-SM one (4-stage ring, 128 registers).
pub const MMAP_OCC_ENV: &str = "KVSTREAM_Q4_MMAP_OCC";

/// Which arithmetic the persistent kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MmapKind {
    /// x as split bf16 (hi + lo), codes as exact bf16, mma.m16n8k16 (`gemv_q4mmap*`).
    SplitBf16,
    /// The split-bf16 kernel for q4_nl_g128: levels looked up as int8, converted to exact bf16
    /// (`gemv_q4nlmmap*`, x prepared by `gemv_q4mma_xprep`).
    SplitBf16Nl,
    /// x as 22-bit integers in three bytes, codes as u8, mma.m16n8k32 (`gemv_q4i8p*`).
    Int8,
    /// The integer kernel for q4_nl_g128: codes looked up as int8 levels, mma.m16n8k32.s8.s8
    /// (`gemv_q4nli8p*`, x prepared by `gemv_q4nl_i8_xprep`).
    Int8Nl,
    /// The integer kernel with x's three bytes in the B columns of one MMA per 2-token pair
    /// (`gemv_q4i8c*`, x prepared by `gemv_q4i8c_xprep`).
    Int8Cols,
    /// [`Self::Int8Cols`] for q4_nl_g128 (`gemv_q4nli8c*`, x by `gemv_q4nl_i8c_xprep`).
    Int8ColsNl,
}

impl MmapKind {
    /// The persistent kernel a q4_g128 path runs (Auto resolved), `None` for SIMT.
    pub(crate) fn for_path(path: super::q4mma::Q4Gemv) -> Option<Self> {
        match path.resolved() {
            super::q4mma::Q4Gemv::MmaPersistent => Some(MmapKind::SplitBf16),
            super::q4mma::Q4Gemv::Int8 => Some(MmapKind::Int8),
            super::q4mma::Q4Gemv::Int8Cols => Some(MmapKind::Int8Cols),
            super::q4mma::Q4Gemv::Simt | super::q4mma::Q4Gemv::Auto => None,
        }
    }

    /// The persistent kernel a 4-bit weight of `dtype` runs on `path`: q4_g128 as
    /// [`Self::for_path`], q4_nl_g128 its own builds of the same kernels; `None` for SIMT and for
    /// other dtypes.
    pub(crate) fn for_weight(
        path: super::q4mma::Q4Gemv,
        dtype: kvstream_memory_contracts::backend::WeightDType,
    ) -> Option<Self> {
        use kvstream_memory_contracts::backend::WeightDType;
        match (dtype, Self::for_path(path)?) {
            (WeightDType::Q4G128, kind) => Some(kind),
            (WeightDType::Q4NlG128, MmapKind::Int8) => Some(MmapKind::Int8Nl),
            (WeightDType::Q4NlG128, MmapKind::Int8Cols) => Some(MmapKind::Int8ColsNl),
            (WeightDType::Q4NlG128, MmapKind::SplitBf16) => Some(MmapKind::SplitBf16Nl),
            _ => None,
        }
    }
}

/// The staged (`_xs`) kernels, in the bit order of `Q4GemvState::xs_reserved`.
pub(crate) const STAGED_KERNELS: [&str; 14] = [
    "gemv_q4mmap_xs",
    "gemv_q4mmap3_xs",
    "gemv_q4i8p_xs",
    "gemv_q4i8p1_xs",
    "gemv_q4nli8p_xs",
    "gemv_q4nli8p1_xs",
    "gemv_q4nlmmap_xs",
    "gemv_q4nlmmap3_xs",
    "gemv_q4i8c1_xs",
    "gemv_q4i8c2_xs",
    "gemv_q4i8c4_xs",
    "gemv_q4nli8c1_xs",
    "gemv_q4nli8c2_xs",
    "gemv_q4nli8c4_xs",
];

/// The kernel for `kind`, `t` tokens, `per_sm` blocks per SM and x staged or not.
fn kernel_name(kind: MmapKind, t: usize, per_sm: usize, staged: bool) -> &'static str {
    match (kind, per_sm, t, staged) {
        (MmapKind::SplitBf16, 3, _, true) => "gemv_q4mmap3_xs",
        (MmapKind::SplitBf16, 3, _, false) => "gemv_q4mmap3",
        (MmapKind::SplitBf16, _, _, true) => "gemv_q4mmap_xs",
        (MmapKind::SplitBf16, _, _, false) => "gemv_q4mmap",
        (MmapKind::SplitBf16Nl, 3, _, true) => "gemv_q4nlmmap3_xs",
        (MmapKind::SplitBf16Nl, 3, _, false) => "gemv_q4nlmmap3",
        (MmapKind::SplitBf16Nl, _, _, true) => "gemv_q4nlmmap_xs",
        (MmapKind::SplitBf16Nl, _, _, false) => "gemv_q4nlmmap",
        (MmapKind::Int8, _, 1, true) => "gemv_q4i8p1_xs",
        (MmapKind::Int8, _, 1, false) => "gemv_q4i8p1",
        (MmapKind::Int8, _, _, true) => "gemv_q4i8p_xs",
        (MmapKind::Int8, _, _, false) => "gemv_q4i8p",
        (MmapKind::Int8Nl, _, 1, true) => "gemv_q4nli8p1_xs",
        (MmapKind::Int8Nl, _, 1, false) => "gemv_q4nli8p1",
        (MmapKind::Int8Nl, _, _, true) => "gemv_q4nli8p_xs",
        (MmapKind::Int8Nl, _, _, false) => "gemv_q4nli8p",
        // Column-packed: one build per number of 2-token pairs (1, 2, 4).
        (MmapKind::Int8Cols, _, 0..=2, true) => "gemv_q4i8c1_xs",
        (MmapKind::Int8Cols, _, 0..=2, false) => "gemv_q4i8c1",
        (MmapKind::Int8Cols, _, 3..=4, true) => "gemv_q4i8c2_xs",
        (MmapKind::Int8Cols, _, 3..=4, false) => "gemv_q4i8c2",
        (MmapKind::Int8Cols, _, _, true) => "gemv_q4i8c4_xs",
        (MmapKind::Int8Cols, _, _, false) => "gemv_q4i8c4",
        (MmapKind::Int8ColsNl, _, 0..=2, true) => "gemv_q4nli8c1_xs",
        (MmapKind::Int8ColsNl, _, 0..=2, false) => "gemv_q4nli8c1",
        (MmapKind::Int8ColsNl, _, 3..=4, true) => "gemv_q4nli8c2_xs",
        (MmapKind::Int8ColsNl, _, 3..=4, false) => "gemv_q4nli8c2",
        (MmapKind::Int8ColsNl, _, _, true) => "gemv_q4nli8c4_xs",
        (MmapKind::Int8ColsNl, _, _, false) => "gemv_q4nli8c4",
    }
}

/// Blocks per SM of the build in use (`__launch_bounds__(256, 2)` or `(256, 3)`); the integer
/// kernel has one build (2).
fn blocks_per_sm_of(kind: MmapKind) -> usize {
    match kind {
        MmapKind::SplitBf16 | MmapKind::SplitBf16Nl => blocks_per_sm(),
        MmapKind::Int8 | MmapKind::Int8Nl | MmapKind::Int8Cols | MmapKind::Int8ColsNl => 2,
    }
}

/// Floats of one scratch slot of `kind` (`QC_SLOT` / 128 in gemv_mma.cu).
fn slot_floats(kind: MmapKind) -> usize {
    match kind {
        MmapKind::Int8Cols | MmapKind::Int8ColsNl => COLS_SLOT_FLOATS,
        _ => SLOT_FLOATS,
    }
}

/// Blocks per SM of the split-bf16 build in use (`__launch_bounds__(256, 2)` or `(256, 3)`).
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
/// A/B switch: `KVSTREAM_Q4_GRID_PER_SM=1` launches one block per SM instead of the build's
/// resident count (fewer warps, more items each, fewer shared tiles). Unset: the build's count.
pub const Q4_GRID_PER_SM_ENV: &str = "KVSTREAM_Q4_GRID_PER_SM";

/// Blocks per SM of the grid for a build that keeps `per_sm` resident (never more).
fn grid_per_sm(per_sm: usize) -> usize {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *V.get_or_init(|| {
        std::env::var(Q4_GRID_PER_SM_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
    });
    forced.map_or(per_sm, |f| f.min(per_sm))
}

/// A/B switch: `KVSTREAM_Q4_XS=0` never stages x in shared memory (the kernels read it from
/// global memory through L1).
pub const Q4_XS_ENV: &str = "KVSTREAM_Q4_XS";

fn stage_x() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(Q4_XS_ENV).map_or(true, |v| v.trim() != "0"))
}

/// Shared memory of one SM on Hopper (the x staging is sized so the build's blocks fit).
const SM_SHARED_BYTES: usize = 228 * 1024;
/// Static shared memory of the kernels (none) plus the driver's per-block reservation.
const STATIC_SHARED_BYTES: usize = 1024;
/// Floats of one scratch slot: a 16-row tile's partial sums for up to 8 tokens (4 per lane).
const SLOT_FLOATS: usize = 128;
/// Floats of one scratch slot of the column-packed kernels: 4 pairs × 2 rows per lane (`QC_SLOT`).
const COLS_SLOT_FLOATS: usize = 256;

/// One launch of the persistent kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Q4MmapPlan {
    /// Blocks of the grid (8 warps each).
    pub(crate) blocks: u32,
    /// 16-row tiles of the weight.
    pub(crate) tiles: usize,
}

/// The plan for `[n, k]` q4_g128 codes at `w_ptr` (scales at byte `soff`) on `sms`
/// multiprocessors with `per_sm` resident blocks each, or `None` when the shape does not suit the
/// kernel (K not a multiple of 128, unaligned codes or scales, more than 2^31 work items, fewer
/// items than the 8 warps of one block). The grid is one full wave, `sms · per_sm` blocks, fewer
/// when the items are fewer than the warps: every warp holds at least one item (the fix-up counts
/// the warps between a tile's first and last owner).
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
    let tiles = n.div_ceil(16);
    let work = tiles.checked_mul(k / GROUP)?;
    if work >= 1 << 31 {
        return None;
    }
    let blocks = (sms.max(1) * per_sm.max(1)).min(work / WARPS);
    if blocks == 0 {
        return None;
    }
    Some(Q4MmapPlan {
        blocks: u32::try_from(blocks).ok()?,
        tiles,
    })
}

/// Most dynamic shared memory `_xs` takes: `per_sm` blocks per SM still fit.
fn staged_limit(max_smem_optin: usize, per_sm: usize) -> usize {
    (SM_SHARED_BYTES / per_sm.max(1))
        .saturating_sub(STATIC_SHARED_BYTES)
        .min(max_smem_optin.saturating_sub(STATIC_SHARED_BYTES))
}

/// Bytes of x fragments `_xs` stages in shared memory for `t` tokens of `k` values (split bf16: 4
/// bytes per value; integer: 400 bytes per 128-group; plus one 16-byte pad per token), when
/// `per_sm` blocks per SM still fit (else the plain kernel reads x from global memory).
fn staged_x_bytes(
    kind: MmapKind,
    t: usize,
    k: usize,
    max_smem_optin: usize,
    per_sm: usize,
) -> Option<usize> {
    let per_token = match kind {
        MmapKind::SplitBf16 | MmapKind::SplitBf16Nl => k * 4,
        MmapKind::Int8 | MmapKind::Int8Nl => k / GROUP * super::q4mma::I8_XPREP_BYTES_PER_GROUP,
        MmapKind::Int8Cols | MmapKind::Int8ColsNl => {
            k / GROUP * super::q4mma::I8C_XPREP_BYTES_PER_GROUP
        }
    };
    let bytes = t * (per_token + 16);
    (bytes <= staged_limit(max_smem_optin, per_sm)).then_some(bytes)
}

impl CudaBackend {
    /// The fix-up buffers for `plan`: two scratch slots per warp of the grid and a counter per
    /// tile (the shared holder of [`super::streamk`]).
    fn mmap_buffers(
        &self,
        plan: Q4MmapPlan,
        kind: MmapKind,
    ) -> Result<(Arc<DeviceAlloc>, Arc<DeviceAlloc>), OpError> {
        self.stream_k_buffers(
            plan.blocks as usize * WARPS * 2 * slot_floats(kind) * 4,
            plan.tiles * 4,
        )
    }

    /// The plan for a q4_g128 weight on this device (the build in use decides the grid).
    pub(crate) fn q4_mmap_plan(
        &self,
        kind: MmapKind,
        n: usize,
        k: usize,
        w_ptr: u64,
        soff: u64,
    ) -> Option<Q4MmapPlan> {
        let per_sm = blocks_per_sm_of(kind);
        q4_mmap_plan(n, k, w_ptr, soff, self.sm_count, grid_per_sm(per_sm))
    }

    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` on the tensor cores, persistent kernel (`t` ≤ 8).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_q4_mmap(
        &self,
        plan: Q4MmapPlan,
        kind: MmapKind,
        x: &CudaTensor,
        w_ptr: u64,
        soff: u64,
        y: &CudaTensor,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("gemv_q4_mmap", t, n, k, blocks = plan.blocks).entered();
        // The producer of x may have written its x-prep bytes (`super::prepared`): then no
        // x-prep launch. `_made` lives until the GEMV is enqueued.
        let (xfp, _made) = match Self::prepared_for(x, kind, t, k) {
            Some(p) => (p.alloc.ptr(), None),
            None => {
                let m = self.xprep(x, t, k, kind)?;
                (m.ptr(), Some(m))
            }
        };
        // The tile-owning kernel, where selected for this shape (`super::q4tiles`).
        if let Some(tp) = self.q4_tiles_plan(kind, n, k, t, w_ptr, soff) {
            return self.gemv_q4_tiles(tp, kind, xfp, w_ptr, soff, y, t, n, k);
        }
        let (scratch, counters) = self.mmap_buffers(plan, kind)?;
        let per_sm = blocks_per_sm_of(kind);
        let staged = staged_x_bytes(kind, t, k, self.max_smem_optin, per_sm).filter(|_| stage_x());
        let name = kernel_name(kind, t, per_sm, staged.is_some());
        let smem = staged.unwrap_or(0);
        let f = self.func(name)?;
        // Static + dynamic shared memory beyond 48 KiB needs the opt-in, once per kernel for the
        // largest size.
        let bit = STAGED_KERNELS
            .iter()
            .position(|&s| s == name)
            .map_or(0, |i| 1u32 << i);
        if smem > 0 {
            let bytes = staged_limit(self.max_smem_optin, per_sm);
            super::q4mma::reserve_smem_once(f, name, bytes, &self.q4_gemv.xs_reserved, bit)?;
        }
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks, 1, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let yp = y.ptr();
        let (t32, k64, n64) = (t as i32, k as u64, n as u64);
        let (sp, cp) = (scratch.ptr(), counters.ptr());
        let mut a = args![&xfp, &w_ptr, &yp, &t32, &k64, &n64, &soff, &sp, &cp];
        self.launch_q4_gemv(f, cfg, &mut a)
    }

    /// Launches a q4 tensor-core GEMV: as a programmatic dependent of the kernel before it (its
    /// x prep or the producer of x) unless [`Q4_PDL_ENV`] turns that off.
    pub(crate) fn launch_q4_gemv(
        &self,
        f: &cudarc::driver::CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), OpError> {
        if dependent_launch() {
            self.launch_dependent("gemv", f, cfg, args)
        } else {
            self.launch("gemv", f, cfg, args)
        }
    }

    /// x in the fragment layout `kind` reads, by its x-prep kernel.
    fn xprep(
        &self,
        x: &CudaTensor,
        t: usize,
        k: usize,
        kind: MmapKind,
    ) -> Result<CudaTensor, OpError> {
        use super::q4mma::{I8C_XPREP_BYTES_PER_GROUP as COLS, I8_XPREP_BYTES_PER_GROUP as I8};
        self.note_xprep_launch();
        Ok(match kind {
            MmapKind::SplitBf16 | MmapKind::SplitBf16Nl => self.q4_mma_xprep(x, t, k)?,
            MmapKind::Int8 => self.q4_i8_xprep(x, t, k, "gemv_q4i8_xprep", I8)?,
            MmapKind::Int8Nl => self.q4_i8_xprep(x, t, k, "gemv_q4nl_i8_xprep", I8)?,
            MmapKind::Int8Cols => self.q4_i8_xprep(x, t, k, "gemv_q4i8c_xprep", COLS)?,
            MmapKind::Int8ColsNl => self.q4_i8_xprep(x, t, k, "gemv_q4nl_i8c_xprep", COLS)?,
        })
    }
}

/// Environment switch for the programmatic dependent launch of the q4 tensor-core GEMVs after
/// their x-prep kernel (`0` turns it off; default on).
pub const Q4_PDL_ENV: &str = "KVSTREAM_Q4_PDL";

/// Whether the GEMV launches as a programmatic dependent of its x-prep kernel: its blocks start
/// while x-prep runs and stream their first weights before `griddepcontrol.wait` (gemv_mma.cu).
fn dependent_launch() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(Q4_PDL_ENV).map_or(true, |v| v != "0"))
}

#[cfg(test)]
mod tests {
    use super::super::streamk::{owner, start};
    use super::*;

    #[test]
    fn plan_needs_whole_groups_and_aligned_codes() {
        assert!(q4_mmap_plan(64, 1024, 0, 0, 132, 2).is_some());
        assert!(q4_mmap_plan(64, 1000, 0, 0, 132, 2).is_none());
        assert!(q4_mmap_plan(64, 1024, 8, 0, 132, 2).is_none());
        assert!(q4_mmap_plan(64, 1024, 0, 3, 132, 2).is_none());
        assert!(q4_mmap_plan(0, 1024, 0, 0, 132, 2).is_none());
        // One full wave, or fewer blocks when the items are fewer than the warps.
        assert_eq!(
            q4_mmap_plan(17408, 5120, 0, 0, 132, 2).map(|p| p.blocks),
            Some(264)
        );
        assert_eq!(
            q4_mmap_plan(16, 1024, 0, 0, 132, 2).map(|p| p.blocks),
            Some(1)
        );
        // Fewer items than one block's warps: no plan (the SIMT kernels take it).
        assert_eq!(q4_mmap_plan(16, 256, 0, 0, 132, 2), None);
    }

    /// Mirrors the kernel's split: every item has exactly one owner, ranges are contiguous and
    /// equal within one item, a tile's contributors are consecutive warps, and a warp shares at
    /// most its first and its last tile (its two scratch slots).
    #[test]
    fn stream_k_split_covers_every_item_once() {
        for &(n, k, sms) in &[
            (17408, 5120, 132),
            (5120, 17408, 132),
            (12288, 5120, 132),
            (7, 1024, 132),
            (70, 256, 1),
            (4133, 256, 3),
        ] {
            for per_sm in [2, 3] {
                let p = q4_mmap_plan(n, k, 0, 0, sms, per_sm).expect("plan");
                let warps = p.blocks as usize * WARPS;
                let ng = k / GROUP;
                let work = p.tiles * ng;
                assert!(p.blocks as usize <= sms * per_sm);
                let mut covered = 0;
                for w in 0..warps {
                    let (i0, i1) = (start(w, warps, work), start(w + 1, warps, work));
                    assert!(i1 > i0, "{n}x{k}: warp {w} empty");
                    assert!(i1 - i0 <= work.div_ceil(warps) && i1 - i0 + 1 >= work / warps);
                    for i in i0..i1 {
                        assert_eq!(owner(i, warps, work), w, "{n}x{k} item {i}");
                    }
                    covered += i1 - i0;
                    if i1 > i0 {
                        let (first, last) = (i0 / ng, (i1 - 1) / ng);
                        for t in first..=last {
                            let whole = t * ng >= i0 && t * ng + ng <= i1;
                            assert!(whole || t == first || t == last, "{n}x{k}: tile {t}");
                        }
                    }
                }
                assert_eq!(covered, work);
                for t in 0..p.tiles {
                    let (w0, w1) = (
                        owner(t * ng, warps, work),
                        owner(t * ng + ng - 1, warps, work),
                    );
                    assert!(w0 <= w1);
                    for w in w0..=w1 {
                        let (i0, i1) = (start(w, warps, work), start(w + 1, warps, work));
                        assert!(
                            i0 < i1 && i0 < t * ng + ng && i1 > t * ng,
                            "tile {t} warp {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn x_is_staged_only_when_the_blocks_still_fit() {
        let optin = 227 * 1024;
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 1, 5120, optin, 2),
            Some(20_496)
        );
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 1, 17408, optin, 2),
            Some(69_648)
        );
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 4, 5120, optin, 2),
            Some(81_984)
        );
        assert_eq!(staged_x_bytes(MmapKind::SplitBf16, 8, 5120, optin, 2), None);
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 4, 17408, optin, 2),
            None
        );
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 1, 17408, 48 * 1024, 2),
            None
        );
        // Three blocks per SM: 75 KiB at most.
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 1, 5120, optin, 3),
            Some(20_496)
        );
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 1, 17408, optin, 3),
            Some(69_648)
        );
        assert_eq!(
            staged_x_bytes(MmapKind::SplitBf16, 2, 17408, optin, 3),
            None
        );
        for per_sm in [2, 3] {
            assert!(staged_limit(optin, per_sm) + STATIC_SHARED_BYTES <= SM_SHARED_BYTES / per_sm);
        }
        // Integer x: 400 bytes per group (+16 per token): T = 1 fits at every 27B shape, T = 2
        // fits at K = 5120 only.
        let i8 = |t, k| staged_x_bytes(MmapKind::Int8, t, k, optin, 2);
        // The column-packed layout is the same size.
        for (t, k) in [(1, 5120), (2, 17408), (8, 17408)] {
            assert_eq!(staged_x_bytes(MmapKind::Int8Cols, t, k, optin, 2), i8(t, k));
        }
        assert_eq!(i8(1, 5120), Some(16_016));
        assert_eq!(i8(1, 17408), Some(54_416));
        assert_eq!(i8(2, 17408), Some(108_832));
        assert_eq!(i8(4, 5120), Some(64_064));
        assert_eq!(i8(8, 17408), None);
    }

    #[test]
    fn every_staged_kernel_has_a_reservation_bit_and_names_match_the_build() {
        for kind in [
            MmapKind::SplitBf16,
            MmapKind::Int8,
            MmapKind::Int8Nl,
            MmapKind::SplitBf16Nl,
            MmapKind::Int8Cols,
            MmapKind::Int8ColsNl,
        ] {
            for t in 1..=8 {
                for per_sm in [2, 3] {
                    let staged = kernel_name(kind, t, per_sm, true);
                    assert!(STAGED_KERNELS.contains(&staged), "{staged}");
                    let plain = kernel_name(kind, t, per_sm, false);
                    assert_eq!(format!("{plain}_xs"), staged);
                }
            }
        }
        assert_eq!(kernel_name(MmapKind::Int8, 1, 2, false), "gemv_q4i8p1");
        assert_eq!(kernel_name(MmapKind::Int8, 2, 2, false), "gemv_q4i8p");
        assert_eq!(kernel_name(MmapKind::Int8Nl, 1, 2, false), "gemv_q4nli8p1");
        // Column-packed: the build of ceil(T / 2) token pairs, rounded up to 1, 2 or 4.
        for (t, name) in [
            (1, "c1"),
            (2, "c1"),
            (3, "c2"),
            (4, "c2"),
            (5, "c4"),
            (8, "c4"),
        ] {
            assert_eq!(
                kernel_name(MmapKind::Int8Cols, t, 2, false),
                format!("gemv_q4i8{name}")
            );
            assert_eq!(
                kernel_name(MmapKind::Int8ColsNl, t, 2, true),
                format!("gemv_q4nli8{name}_xs")
            );
        }
        for name in STAGED_KERNELS {
            assert!(kvstream_kernels::module_of(name).is_some(), "{name}");
            assert!(
                kvstream_kernels::module_of(&name[..name.len() - 3]).is_some(),
                "{name}"
            );
        }
        // q4_nl_g128 runs its builds of the tensor-core kernels, SIMT on the SIMT path.
        use super::super::q4mma::Q4Gemv;
        use kvstream_memory_contracts::backend::WeightDType;
        let nl = WeightDType::Q4NlG128;
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::Auto, nl),
            Some(MmapKind::Int8ColsNl)
        );
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::Int8, nl),
            Some(MmapKind::Int8Nl)
        );
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::MmaPersistent, nl),
            Some(MmapKind::SplitBf16Nl)
        );
        assert_eq!(MmapKind::for_weight(Q4Gemv::Simt, nl), None);
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::Int8Cols, nl),
            Some(MmapKind::Int8ColsNl)
        );
        let q4 = WeightDType::Q4G128;
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::Auto, q4),
            Some(MmapKind::Int8Cols)
        );
        assert_eq!(MmapKind::for_weight(Q4Gemv::Int8, q4), Some(MmapKind::Int8));
        assert_eq!(
            MmapKind::for_weight(Q4Gemv::MmaPersistent, q4),
            Some(MmapKind::SplitBf16)
        );
        assert_eq!(MmapKind::for_weight(Q4Gemv::Auto, WeightDType::Q8_0), None);
        assert!(STAGED_KERNELS.len() <= 32);
    }
}
