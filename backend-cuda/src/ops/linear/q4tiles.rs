//! The tile-owning q4 decode GEMV (`gemv_q4i8t*` / `gemv_q4nli8t*` in
//! `kernels/src/cu/gemv_mma.cu`): the column-packed integer arithmetic of the stream-K kernels
//! (`gemv_q4i8c*`, the same prepared x), but a producer warp per block streams the weights into a
//! shared-memory ring with bulk copies, and a block owns whole 16-row tiles (no fix-up).
//!
//! Taken, when [`Q4_TILES_ENV`] selects it, for every q4 GEMV of a suitable shape (K a multiple
//! of 1,024, 16-byte aligned codes and scales, two stages fit: whole tiles up to K = 6144 on
//! Hopper, K/128-divisor chunks with rows of >= 2 KiB beyond): the choice depends on the shape
//! only, never on T,
//! so a row of an MTP verification call equals the single step bit for bit (the kernel's sums are
//! a function of N and K only).

use super::q4mmap::MmapKind;
use crate::launch::args;
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::Ordering;

/// Environment switch: `1` runs the tile-owning kernel for every suitable q4 GEMV shape, a number
/// of MiB (e.g. `64`) for suitable weights of at most that many code bytes, `0` or unset never.
pub const Q4_TILES_ENV: &str = "KVSTREAM_Q4_TILES";

/// Environment switch: `1` gives the tile-owning kernel's blocks equal runs of stages instead of
/// whole tiles (a tile at a range boundary is split between two neighbouring blocks, its halves
/// added by the later one: [`split_stage_groups`]); unset or `0` whole tiles. Takes effect in
/// builds with `QT_SHARE` on (gemv_mma.cu); the others keep whole tiles per block.
pub const Q4_TILES_SPLIT_ENV: &str = "KVSTREAM_Q4_TILES_SPLIT";

/// `QT_SHARE`'s default in gemv_mma.cu (both consumer groups read every stage): split ranges
/// need it.
const QT_SHARE_DEFAULT: bool = false;

/// Whether the kernels are built with `QT_SHARE` on (their default, or `KVSTREAM_NVRTC_DEFINES`).
fn qt_share() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::compile::define_on("QT_SHARE", QT_SHARE_DEFAULT))
}

/// Floats of one split-scratch slot (`QT_SPLIT_SLOT` in gemv_mma.cu: 2 values per token pair and
/// lane, up to 4 pairs).
const SPLIT_SLOT_FLOATS: usize = 256;

/// Consumer warps (two groups of 8, `QT_GW`) plus the producer warp.
const THREADS: usize = (2 * 8 + 1) * 32;
/// Resident blocks per SM (`__launch_bounds__(QT_THREADS, 1)`).
const BLOCKS_PER_SM: usize = 1;
/// Shared memory of one SM on Hopper, and the driver's per-block reservation.
const SM_SHARED_BYTES: usize = 228 * 1024;
const RESERVED_PER_BLOCK: usize = 1024;
/// Fewest ring stages (whole tiles) worth a launch: one in flight while one is read.
const MIN_STAGES: usize = 2;

/// Fewest code bytes per row of a stage that is not a whole tile: each such row is its own bulk
/// copy, and the copy unit's rate per operation (one per ~70 SM cycles, session 22) must not be
/// the limit.
const MIN_ROW_BYTES: usize = 2048;

/// Split ranges ([`Q4_TILES_SPLIT_ENV`]) may cut rows down to this many code bytes: the cut is
/// then chosen by [`split_stage_groups`]'s cost, which charges each copy [`COPY_OP_BYTES`].
const MIN_SPLIT_ROW_BYTES: usize = 1024;

/// What one bulk copy costs the producer, in bytes of an SM's share of HBM time: the copy unit
/// takes one operation per ~70 SM cycles (session 22), ~39 ns, while an H200 SM's share of
/// 4.5 TB/s is ~34 GB/s.
const COPY_OP_BYTES: usize = 1300;

/// Bytes of one ring stage of `chunk` groups: 16 rows of `chunk · 64` code bytes and the tile's
/// scales (`16 · K/128 · 2`), rounded up to 128.
fn stage_bytes(k: usize, chunk: usize) -> usize {
    (16 * (chunk * 64 + k / 128 * 2)).next_multiple_of(128)
}

/// Groups per stage for K = `k`: the whole tile where two such stages fit beside the largest
/// build's sums (x read through L1), else the largest divisor of K/128 with rows of at least
/// [`MIN_ROW_BYTES`] that fits twice; `None` when none does. A function of K and the device only.
fn stage_groups(k: usize, budget: usize) -> Option<usize> {
    let ng = k / 128;
    (1..=ng)
        .rev()
        .filter(|&c| ng % c == 0 && (c == ng || c * 64 >= MIN_ROW_BYTES))
        .find(|&c| layout(MIN_STAGES, stage_bytes(k, c), pairs(8), 0, budget).is_some())
}

/// Groups per stage when block ranges are equal runs of stages (`split`): the cut, among the
/// divisors of K/128 no larger than [`stage_groups`]'s with rows of at least
/// [`MIN_SPLIT_ROW_BYTES`], that gives the heaviest block the least work — its stages
/// (`⌈tiles · stages per tile / blocks⌉`) times the larger of a stage's bytes and its copies'
/// cost; ties go to the larger cut. E.g. the 27B out projection (5120×6144, 320 tiles on 132
/// SMs): half tiles, 5 stages of 26 KB per block instead of 3 whole tiles of 50 KB.
fn split_stage_groups(tiles: usize, k: usize, blocks: usize, budget: usize) -> Option<usize> {
    let ng = k / 128;
    let whole = stage_groups(k, budget)?;
    let cost = |c: usize| {
        // A whole tile is one code copy; a cut is one per row (16). Plus the scales' copy.
        let copies = if c == ng { 1 } else { 16 } + 1;
        let per_stage = stage_bytes(k, c).max(copies * COPY_OP_BYTES);
        (tiles * (ng / c)).div_ceil(blocks.max(1)) * per_stage
    };
    (1..=whole)
        .rev()
        .filter(|&c| ng % c == 0 && (c == whole || c * 64 >= MIN_SPLIT_ROW_BYTES))
        .min_by_key(|&c| (cost(c), std::cmp::Reverse(c)))
}

/// The first and one-past-last stage of block `b` of `blocks` (gemv_mma.cu's `q4i8t_body`):
/// whole tiles, or with `split` an equal run of the `tiles · nch` stages.
#[cfg(test)]
fn block_stages(b: usize, blocks: usize, tiles: usize, nch: usize, split: bool) -> (usize, usize) {
    let units = if split { tiles * nch } else { tiles };
    let (u0, u1) = (b * units / blocks, (b + 1) * units / blocks);
    if split {
        (u0, u1)
    } else {
        (u0 * nch, u1 * nch)
    }
}

/// Which q4 GEMV shapes take the tile-owning kernel (`KVSTREAM_Q4_TILES`, or
/// `CudaBackend::set_q4_tiles`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4Tiles {
    /// Never (the stream-K kernels).
    Off,
    /// Every suitable shape.
    On,
    /// Suitable weights of at most this many code bytes.
    UpTo(usize),
}

impl Q4Tiles {
    /// The selection an environment value names: `1` on, a number of MiB, `0` / unset / other off.
    pub fn parse(v: Option<&str>) -> Self {
        match v.map(str::trim) {
            None | Some("") | Some("0") => Q4Tiles::Off,
            Some("1") => Q4Tiles::On,
            Some(s) => s
                .parse::<usize>()
                .map_or(Q4Tiles::Off, |mib| Q4Tiles::UpTo(mib << 20)),
        }
    }

    fn takes(self, n: usize, k: usize) -> bool {
        match self {
            Q4Tiles::Off => false,
            Q4Tiles::On => true,
            Q4Tiles::UpTo(bytes) => n * (k / 2) <= bytes,
        }
    }

    /// As one word (`Q4GemvState::tiles`): 0 off, `u64::MAX` on, else the byte bound.
    pub(crate) fn code(self) -> u64 {
        match self {
            Q4Tiles::Off => 0,
            Q4Tiles::On => u64::MAX,
            Q4Tiles::UpTo(b) => (b as u64).clamp(1, u64::MAX - 1),
        }
    }

    pub(crate) fn from_code(c: u64) -> Self {
        match c {
            0 => Q4Tiles::Off,
            u64::MAX => Q4Tiles::On,
            b => Q4Tiles::UpTo(usize::try_from(b).unwrap_or(usize::MAX)),
        }
    }

    /// The selection of [`Q4_TILES_ENV`].
    pub(crate) fn from_env() -> Self {
        Self::parse(std::env::var(Q4_TILES_ENV).ok().as_deref())
    }
}

/// One launch: grid, ring depth, where the ring starts, whether x is staged, shared bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TilesPlan {
    pub(crate) blocks: u32,
    pub(crate) stages: u32,
    pub(crate) ring_off: u32,
    pub(crate) stage_bytes: u32,
    /// Groups of 128 values per stage (a divisor of K/128; K/128 = whole tiles).
    pub(crate) chunk: u32,
    pub(crate) staged_x: bool,
    pub(crate) smem: u32,
    /// Block ranges are equal runs of stages (a boundary tile finished by the later block,
    /// through the split scratch), not whole tiles.
    pub(crate) split: bool,
}

/// Token pairs of the build for `t` tokens (1, 2 or 4).
fn pairs(t: usize) -> usize {
    match t {
        0..=2 => 1,
        3..=4 => 2,
        _ => 4,
    }
}

/// Shared memory one block may take with [`BLOCKS_PER_SM`] resident.
fn block_budget(max_smem_optin: usize) -> usize {
    (SM_SHARED_BYTES / BLOCKS_PER_SM - RESERVED_PER_BLOCK).min(max_smem_optin)
}

/// The layout of gemv_mma.cu's `q4i8t_body`: barriers (16 bytes per stage), tile sums
/// (8,192 bytes per token pair), x when staged (`t` rows of `NG · 25 + 1` uint4), the ring of
/// `stage` bytes per stage at the next 128-byte boundary. `None` when fewer than [`MIN_STAGES`]
/// fit.
fn layout(
    stages_wanted: usize,
    stage: usize,
    np: usize,
    x_bytes: usize,
    budget: usize,
) -> Option<(usize, usize)> {
    let ring_off_for = |s: usize| (16 * s + 8192 * np + x_bytes).next_multiple_of(128);
    // Even: each consumer group has its own half of the slots (`qt_slot` in gemv_mma.cu).
    let mut s = stages_wanted.max(MIN_STAGES).next_multiple_of(2);
    while s >= MIN_STAGES {
        let off = ring_off_for(s);
        if off + s * stage <= budget {
            return Some((s, off));
        }
        s -= 2;
    }
    None
}

/// The plan for `t` tokens of `[n, k]` q4 codes at `w_ptr` (scales at byte `soff`) on `sms`
/// multiprocessors, or `None` when the shape does not suit the kernel (K not a multiple of
/// 1,024, unaligned codes or scales, T outside 1..=8, no room for two stages). `split`: equal
/// runs of stages per block ([`Q4_TILES_SPLIT_ENV`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tiles_plan(
    n: usize,
    k: usize,
    t: usize,
    w_ptr: u64,
    soff: u64,
    sms: usize,
    max_smem_optin: usize,
    split: bool,
) -> Option<TilesPlan> {
    if n == 0 || k == 0 || k % 1024 != 0 || w_ptr % 16 != 0 || soff % 16 != 0 {
        return None;
    }
    if !(1..=8).contains(&t) {
        return None;
    }
    let tiles = n.div_ceil(16);
    let blocks = (sms.max(1) * BLOCKS_PER_SM).min(tiles);
    let np = pairs(t);
    let budget = block_budget(max_smem_optin);
    // Whether the shape runs here, and how its stages are cut, must not depend on T (a
    // verification row must equal the single step bit for bit): two stages must fit beside the
    // largest build's sums, x read through L1.
    // Every range holds at least one tile's stages (blocks ≤ tiles), so a tile meets at most
    // two ranges.
    let chunk = if split {
        split_stage_groups(tiles, k, blocks, budget)?
    } else {
        stage_groups(k, budget)?
    };
    let stage = stage_bytes(k, chunk);
    let nch = k / 128 / chunk;
    // The most stages any block streams: more ring than that buys nothing.
    let stages_wanted = if split {
        (tiles * nch).div_ceil(blocks)
    } else {
        tiles.div_ceil(blocks) * nch
    };
    // x staged when it leaves room for two stages (else read through L1).
    let x_bytes = t * ((k / 128) * super::q4mma::I8C_XPREP_BYTES_PER_GROUP + 16);
    let staged = layout(MIN_STAGES, stage, np, x_bytes, budget).is_some();
    let (stages, ring_off) = layout(
        stages_wanted,
        stage,
        np,
        if staged { x_bytes } else { 0 },
        budget,
    )?;
    Some(TilesPlan {
        blocks: u32::try_from(blocks).ok()?,
        stages: u32::try_from(stages).ok()?,
        ring_off: u32::try_from(ring_off).ok()?,
        stage_bytes: u32::try_from(stage).ok()?,
        chunk: u32::try_from(chunk).ok()?,
        staged_x: staged,
        smem: u32::try_from(ring_off + stages * stage).ok()?,
        split,
    })
}

/// The build for `kind`, `t` tokens, x staged or not; `None` for kinds without one.
fn kernel_name(kind: MmapKind, t: usize, staged: bool) -> Option<&'static str> {
    const Q4: [&str; 6] = [
        "gemv_q4i8t1",
        "gemv_q4i8t1_xs",
        "gemv_q4i8t2",
        "gemv_q4i8t2_xs",
        "gemv_q4i8t4",
        "gemv_q4i8t4_xs",
    ];
    const NL: [&str; 6] = [
        "gemv_q4nli8t1",
        "gemv_q4nli8t1_xs",
        "gemv_q4nli8t2",
        "gemv_q4nli8t2_xs",
        "gemv_q4nli8t4",
        "gemv_q4nli8t4_xs",
    ];
    let i = match pairs(t) {
        1 => 0,
        2 => 2,
        _ => 4,
    } + usize::from(staged);
    match kind {
        MmapKind::Int8Cols => Some(Q4[i]),
        MmapKind::Int8ColsNl => Some(NL[i]),
        _ => None,
    }
}

/// Bit of `name` in `Q4GemvState::tiles_reserved` (its shared memory opt-in done).
fn reservation_bit(name: &str) -> u32 {
    let builds = ["1", "1_xs", "2", "2_xs", "4", "4_xs"];
    let (base, rest) = match name.strip_prefix("gemv_q4nli8t") {
        Some(r) => (6, r),
        None => (0, name.strip_prefix("gemv_q4i8t").unwrap_or("")),
    };
    builds
        .iter()
        .position(|&b| b == rest)
        .map_or(0, |i| 1u32 << (base + i))
}

impl CudaBackend {
    /// Which q4 GEMV shapes run the tile-owning kernel now.
    pub fn q4_tiles(&self) -> Q4Tiles {
        Q4Tiles::from_code(self.q4_gemv.tiles.load(Ordering::Relaxed))
    }

    /// Chooses the q4 GEMV shapes of the tile-owning kernel (overrides `KVSTREAM_Q4_TILES`).
    /// Choose before decoding a session, as [`CudaBackend::set_q4_gemv`].
    pub fn set_q4_tiles(&self, sel: Q4Tiles) {
        self.q4_gemv.tiles.store(sel.code(), Ordering::Relaxed);
    }

    /// Whether the tile-owning kernel's blocks take equal runs of stages ([`Q4_TILES_SPLIT_ENV`]).
    pub fn q4_tiles_split(&self) -> bool {
        self.q4_gemv.tiles_split.load(Ordering::Relaxed)
    }

    /// Chooses equal runs of stages (`true`) or whole tiles per block for the tile-owning kernel
    /// (overrides `KVSTREAM_Q4_TILES_SPLIT`). Choose before decoding a session.
    pub fn set_q4_tiles_split(&self, split: bool) {
        self.q4_gemv.tiles_split.store(split, Ordering::Relaxed);
    }

    /// The tile-owning plan for this GEMV when [`Q4_TILES_ENV`] selects its shape and `kind` has
    /// a build.
    pub(crate) fn q4_tiles_plan(
        &self,
        kind: MmapKind,
        n: usize,
        k: usize,
        t: usize,
        w_ptr: u64,
        soff: u64,
    ) -> Option<TilesPlan> {
        // Bulk copies and transaction-counted barriers: sm_90 and later.
        if !self.arch_at_least(90)
            || !self.q4_tiles().takes(n, k)
            || kernel_name(kind, 1, false).is_none()
        {
            return None;
        }
        tiles_plan(
            n,
            k,
            t,
            w_ptr,
            soff,
            self.sm_count,
            self.max_smem_optin,
            self.q4_tiles_split() && qt_share(),
        )
    }

    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` by the tile-owning kernel; `xfp` is x in the column-packed
    /// layout (prepared by its producer or by the x-prep kernel).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_q4_tiles(
        &self,
        plan: TilesPlan,
        kind: MmapKind,
        xfp: u64,
        w_ptr: u64,
        soff: u64,
        y: &CudaTensor,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("gemv_q4_tiles", t, n, k, blocks = plan.blocks).entered();
        let name = kernel_name(kind, t, plan.staged_x).ok_or_else(|| {
            OpError::shape("gemv_q4_tiles", format!("no tile build for {kind:?}"))
        })?;
        let f = self.func(name)?;
        super::q4mma::reserve_smem_once(
            f,
            name,
            block_budget(self.max_smem_optin),
            &self.q4_gemv.tiles_reserved,
            reservation_bit(name),
        )?;
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: plan.smem,
        };
        let yp = y.ptr();
        let (t32, k64, n64) = (t as i32, k as u64, n as u64);
        let (s32, roff, sb, ch) = (
            plan.stages as i32,
            plan.ring_off,
            plan.stage_bytes,
            plan.chunk,
        );
        // Split ranges: one slot of `QT_SPLIT_SLOT` floats per block (slot b takes block b - 1's
        // part of the tile blocks b - 1 and b share), every value empty between launches.
        let scratch = if plan.split {
            Some(self.tiles_split_scratch(plan.blocks as usize * SPLIT_SLOT_FLOATS * 4)?)
        } else {
            None
        };
        let sp = scratch.as_ref().map_or(0u64, |s| s.ptr());
        let mut a = args![&xfp, &w_ptr, &yp, &t32, &k64, &n64, &soff, &s32, &roff, &sb, &ch, &sp];
        self.launch_q4_gemv(f, cfg, &mut a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPTIN: usize = 227 * 1024;

    /// The 27B decode shapes (out, down, qkv+z, q+k+v, gate+up, lm_head) and a small one.
    const SHAPES: [(usize, usize); 7] = [
        (5120, 6144),
        (5120, 17408),
        (16384, 5120),
        (14336, 5120),
        (34816, 5120),
        (248320, 5120),
        (7, 1024),
    ];

    #[test]
    fn selection_parses_on_off_and_a_size() {
        assert_eq!(Q4Tiles::parse(None), Q4Tiles::Off);
        assert_eq!(Q4Tiles::parse(Some("0")), Q4Tiles::Off);
        assert_eq!(Q4Tiles::parse(Some("1")), Q4Tiles::On);
        assert_eq!(Q4Tiles::parse(Some(" 64 ")), Q4Tiles::UpTo(64 << 20));
        assert_eq!(Q4Tiles::parse(Some("yes")), Q4Tiles::Off);
        // 5120×6144 codes are 15 MiB; 34816×5120 are 85 MiB.
        assert!(Q4Tiles::UpTo(64 << 20).takes(5120, 6144));
        assert!(!Q4Tiles::UpTo(64 << 20).takes(34816, 5120));
        for sel in [Q4Tiles::Off, Q4Tiles::On, Q4Tiles::UpTo(64 << 20)] {
            assert_eq!(Q4Tiles::from_code(sel.code()), sel);
        }
    }

    #[test]
    fn plan_needs_whole_stages_aligned_bytes_and_decode_widths() {
        let p = |n, k, t, w, s| tiles_plan(n, k, t, w, s, 132, OPTIN, false);
        assert!(p(5120, 6144, 1, 0, 0).is_some());
        assert!(p(5120, 6144 - 128, 1, 0, 0).is_none(), "K % 1024");
        assert!(p(5120, 1024, 1, 0, 0).is_some());
        assert!(p(5120, 6144, 1, 8, 0).is_none(), "codes 16-aligned");
        assert!(p(5120, 6144, 1, 0, 8).is_none(), "scales 16-aligned");
        assert!(p(5120, 6144, 0, 0, 0).is_none());
        assert!(p(5120, 6144, 9, 0, 0).is_none());
        assert!(p(0, 6144, 1, 0, 0).is_none());
    }

    /// The plan fits the SM's shared memory, mirrors the kernel's layout, keeps two or more
    /// whole tiles per block in flight on the 27B shapes with K ≤ 6144, and cuts K = 17408 into
    /// halves.
    #[test]
    fn plan_fits_the_sm_and_sizes_the_ring() {
        for (n, k) in SHAPES {
            for t in 1..=8 {
                let p = tiles_plan(n, k, t, 0, 0, 132, OPTIN, false).expect("plan at every T");
                let np = pairs(t);
                let x = if p.staged_x {
                    t * ((k / 128) * 400 + 16)
                } else {
                    0
                };
                assert!(p.stages as usize >= MIN_STAGES && p.stages % 2 == 0);
                let c = p.chunk as usize;
                assert_eq!(k / 128 % c, 0);
                assert_eq!(p.stage_bytes as usize, stage_bytes(k, c));
                assert!(p.stage_bytes as usize >= 16 * c * 64 + 16 * (k / 128) * 2);
                // The cut depends on K (and the device) only, never on T.
                assert_eq!(
                    p.chunk,
                    tiles_plan(n, k, 1, 0, 0, 132, OPTIN, false)
                        .expect("T = 1")
                        .chunk
                );
                assert_eq!(p.ring_off % 128, 0);
                assert_eq!(p.stage_bytes % 128, 0);
                assert!(p.ring_off as usize >= 16 * p.stages as usize + 8192 * np + x);
                assert_eq!(
                    p.smem as usize,
                    p.ring_off as usize + p.stages as usize * p.stage_bytes as usize
                );
                assert!(
                    p.smem as usize + RESERVED_PER_BLOCK <= SM_SHARED_BYTES
                        && p.smem as usize <= OPTIN,
                    "{n}x{k} t={t}: {p:?}"
                );
                assert!(p.blocks as usize <= 132 && p.blocks as usize <= n.div_ceil(16));
            }
        }
        // Out projection, one token: x staged (19 KB), 4 whole tiles (49.7 KB each) in the ring:
        // every tile of a block (2 or 3 of the 320) requested at once.
        let out = tiles_plan(5120, 6144, 1, 0, 0, 132, OPTIN, false).expect("plan");
        assert!(out.staged_x);
        assert_eq!(out.blocks, 132);
        assert_eq!(out.stages, 4);
        // Four tokens of K = 5120: x (64 KB) leaves room for 2 stages (3 would fit, but the slots
        // split evenly between the two consumer groups).
        assert_eq!(
            tiles_plan(16384, 5120, 4, 0, 0, 132, OPTIN, false)
                .expect("plan")
                .stages,
            2
        );
        // K = 5120 (qkv+z, q+k+v, gate+up), one token: 4 tiles of 41.5 KB.
        assert_eq!(
            tiles_plan(16384, 5120, 1, 0, 0, 132, OPTIN, false)
                .expect("plan")
                .stages,
            4
        );
        // Whole tiles up to K = 6144.
        for k in [1024, 5120, 6144] {
            assert_eq!(stage_groups(k, block_budget(OPTIN)), Some(k / 128));
        }
        // The down projection's tiles (K = 17408: 139 KB) do not fit twice: halves of 68 groups
        // (4,352-byte rows), x (54 KB) staged at T = 1 beside two of them.
        let down = tiles_plan(5120, 17408, 1, 0, 0, 132, OPTIN, false).expect("plan");
        assert_eq!((down.chunk, down.stages), (68, 2));
        assert!(down.staged_x);
        // No cut fits: K = 1024 · 1021 has 8 · 1021 groups, whose divisors give rows of 512 bytes
        // (too small a copy) or of 64 KB and more (too large a stage).
        assert_eq!(stage_groups(1024 * 1021, block_budget(OPTIN)), None);
        assert!(tiles_plan(64, 1024 * 1021, 1, 0, 0, 132, OPTIN, false).is_none());
        // K = 131072 (1024 groups): stages of 64 groups (4 KiB rows; the tile's 32 KB of scales
        // ride along in each).
        assert_eq!(stage_groups(131072, block_budget(OPTIN)), Some(64));
        // A block streaming one tile still gets two stages (the fewest).
        let few = tiles_plan(132 * 16, 1024, 1, 0, 0, 132, OPTIN, false).expect("plan");
        assert_eq!(few.stages as usize, MIN_STAGES);
        // The kernel runs a shape at every T or at none: x is staged where it still fits.
        assert!(
            tiles_plan(16384, 5120, 4, 0, 0, 132, OPTIN, false)
                .expect("plan")
                .staged_x
        );
        assert!(
            !tiles_plan(5120, 6144, 8, 0, 0, 132, OPTIN, false)
                .expect("plan")
                .staged_x
        );
        for t in 1..=8 {
            // Two tiles of K = 4096 (33 KB each) fit 48 KiB at no T; neither do halves (1 KiB
            // rows are below the copy size).
            assert!(tiles_plan(4096, 4096, t, 0, 0, 2, 48 * 1024, false).is_none());
        }
        // A small device: fewer blocks than tiles, stages capped by the budget.
        let small = tiles_plan(4096, 1024, 1, 0, 0, 2, 64 * 1024, false).expect("plan");
        assert_eq!(small.blocks, 2);
        assert!(small.smem as usize <= 64 * 1024);
    }

    /// Split ranges: the cut evens out the 27B shapes whose whole tiles do not divide well over
    /// 132 SMs (out: half tiles; down: its halves, now split between blocks), leaves the others'
    /// whole tiles, depends on N, K and the device only, and the ring still fits.
    #[test]
    fn split_plan_cuts_unbalanced_shapes_and_never_depends_on_t() {
        let budget = block_budget(OPTIN);
        assert_eq!(split_stage_groups(320, 6144, 132, budget), Some(24));
        assert_eq!(split_stage_groups(320, 17408, 132, budget), Some(68));
        for tiles in [1024, 896, 2176, 15520] {
            assert_eq!(
                split_stage_groups(tiles, 5120, 132, budget),
                Some(40),
                "{tiles}"
            );
        }
        for (n, k) in SHAPES {
            let one = tiles_plan(n, k, 1, 0, 0, 132, OPTIN, true).expect("plan");
            for t in 1..=8 {
                let p = tiles_plan(n, k, t, 0, 0, 132, OPTIN, true).expect("plan at every T");
                assert!(p.split);
                assert_eq!(
                    (p.chunk, p.blocks),
                    (one.chunk, one.blocks),
                    "{n}x{k} t={t}"
                );
                assert!(p.stages as usize >= MIN_STAGES && p.stages % 2 == 0);
                assert!(p.smem as usize <= OPTIN, "{n}x{k} t={t}: {p:?}");
                assert_eq!(
                    p.smem as usize,
                    p.ring_off as usize + p.stages as usize * p.stage_bytes as usize
                );
            }
            // The heaviest block streams no more bytes than with whole tiles per block.
            let whole = tiles_plan(n, k, 1, 0, 0, 132, OPTIN, false).expect("plan");
            let tiles = n.div_ceil(16);
            let heaviest = |p: &TilesPlan| {
                let nch = k / 128 / p.chunk as usize;
                (0..p.blocks as usize)
                    .map(|b| {
                        let (u0, u1) = block_stages(b, p.blocks as usize, tiles, nch, p.split);
                        (u1 - u0) * p.stage_bytes as usize
                    })
                    .max()
                    .unwrap_or(0)
            };
            assert!(heaviest(&one) <= heaviest(&whole), "{n}x{k}");
        }
        // Out projection: 5 or 4 half tiles per block (26 KB each) instead of 3 or 2 whole ones.
        let out = tiles_plan(5120, 6144, 1, 0, 0, 132, OPTIN, true).expect("plan");
        assert_eq!((out.chunk, out.stages), (24, 6));
        let whole = tiles_plan(5120, 6144, 1, 0, 0, 132, OPTIN, false).expect("plan");
        assert!(5 * out.stage_bytes < 3 * whole.stage_bytes * 9 / 10);
    }

    /// The kernel's ranges (mirrored by `block_stages`): a partition of the stages in order, each
    /// range holding at least one tile's stages when blocks ≤ tiles, so a tile meets at most two
    /// neighbouring ranges — the first ending in it (part A), the second starting in it (part B).
    #[test]
    fn split_ranges_partition_the_stages_and_share_a_tile_between_two_blocks() {
        for tiles in 1..60 {
            for nch in 1..5 {
                for blocks in 1..=tiles {
                    for split in [false, true] {
                        let mut next = 0;
                        let mut owners = vec![Vec::new(); tiles];
                        for b in 0..blocks {
                            let (u0, u1) = block_stages(b, blocks, tiles, nch, split);
                            assert_eq!(u0, next);
                            assert!(u1 - u0 >= nch, "{tiles} {nch} {blocks}");
                            next = u1;
                            for o in &mut owners[u0 / nch..=(u1 - 1) / nch] {
                                o.push(b);
                            }
                            if !split {
                                assert_eq!((u0 % nch, u1 % nch), (0, 0));
                            }
                        }
                        assert_eq!(next, tiles * nch);
                        for (tile, o) in owners.iter().enumerate() {
                            assert!(
                                o.len() == 1 || (o.len() == 2 && o[1] == o[0] + 1),
                                "tile {tile}: {o:?} ({tiles} {nch} {blocks})"
                            );
                            if o.len() == 2 {
                                let (_, a1) = block_stages(o[0], blocks, tiles, nch, true);
                                let (b0, _) = block_stages(o[1], blocks, tiles, nch, true);
                                assert_eq!(a1, b0);
                                assert!(b0 % nch != 0 && b0 / nch == tile);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn builds_and_reservation_bits_match_the_kernel_table() {
        let mut bits = 0u32;
        for kind in [MmapKind::Int8Cols, MmapKind::Int8ColsNl] {
            for t in 1..=8 {
                for staged in [false, true] {
                    let name = kernel_name(kind, t, staged).expect("build");
                    assert!(kvstream_kernels::module_of(name).is_some(), "{name}");
                    assert_eq!(name.ends_with("_xs"), staged);
                    let b = reservation_bit(name);
                    assert_eq!(b.count_ones(), 1, "{name}");
                    bits |= b;
                }
            }
        }
        assert_eq!(bits, (1 << 12) - 1);
        assert_eq!(
            kernel_name(MmapKind::Int8Cols, 3, false),
            Some("gemv_q4i8t2")
        );
        assert_eq!(
            kernel_name(MmapKind::Int8ColsNl, 8, true),
            Some("gemv_q4nli8t4_xs")
        );
        assert_eq!(kernel_name(MmapKind::Int8, 1, false), None);
    }
}
