//! When the stream-K decode GEMV (`gemv_sk_*` in `kernels/src/cu/linear.cu`) replaces
//! `gemv_pipe`, and how its grid and work split are sized. Pure functions of the dtype, the shape
//! and the SM count, tested without a GPU.
//!
//! `gemv_pipe` gives each block whole row teams, so when its blocks do not fill the last wave of
//! resident block slots the SMs idle at the end (17408 × 5120 bf16: 2,176 blocks over 132 SMs × 4
//! slots = 4.12 waves, 76–79% of HBM on the H200). The stream-K kernel runs one fixed grid of
//! `SMs × SK_BLOCKS_PER_SM` blocks and cuts the work items — (8-row unit, trip of 32 chunks) —
//! evenly between its warps; units shared by consecutive warps are finished by the last to arrive
//! (buffers: [`super::streamk`]).
//!
//! T-independence: the choice between the kernels and the split depend on the dtype, N, K and the
//! SM count only (never T or the instance), so row t of a T-row call stays bit-identical to a
//! 1-row call.

use super::plan::{chunk_elems, gemv_split, GV_WARPS, ROWS_PER_TEAM};
use kvstream_kernels::launch::GEMV_MAX_T;
use kvstream_memory_contracts::backend::WeightDType;

/// Environment variable choosing the decode GEMV of the element and 8-bit weights: `off` (or
/// unset, [`GemvSk::Off`]), `auto` ([`GemvSk::Auto`]) or `on` ([`GemvSk::On`]).
pub const GEMV_SK_ENV: &str = "KVSTREAM_GEMV_SK";

/// Blocks per SM of the stream-K grid: the `_t1` and `_t4` instances' residency (4 blocks of 128
/// threads, ≤ 128 registers). The same grid for every T (the `_t8` instances, 2 blocks per SM,
/// run it in two full waves).
pub(crate) const SK_BLOCKS_PER_SM: usize = 4;
/// Rows of one work unit (`SK_R` in linear.cu).
pub(crate) const SK_UNIT_ROWS: usize = 8;
/// Floats of one scratch slot (`SK_SLOT`): a unit's partial sums for up to 8 tokens.
pub(crate) const SK_SLOT_FLOATS: usize = SK_UNIT_ROWS * GEMV_MAX_T;
/// Scratch slots per warp (its first and its last unit may be shared).
pub(crate) const SK_SLOTS_PER_WARP: usize = 2;
/// Chunks (16 bytes) per lane pass over a row: one trip of a warp.
const TRIP_CHUNKS: usize = 32;
/// Resident blocks per SM of `gemv_pipe`'s `_t1` instances (`__launch_bounds__(128, 4)`), the
/// wave size the rule measures against.
const PIPE_T1_BLOCKS_PER_SM: usize = 4;
/// [`GemvSk::Auto`] takes stream-K when `gemv_pipe`'s tail wastes more than this share.
pub(crate) const MAX_TAIL_LOSS: f64 = 0.05;
/// ... and every warp gets at least this many work items.
pub(crate) const MIN_ITEMS_PER_WARP: usize = 2;

/// Which kernel computes a decode GEMV (T ≤ 8) of f32, f16, bf16, q8_0 or fp8_e4m3 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvSk {
    /// Stream-K where `gemv_pipe`'s last wave is poorly filled ([`use_stream_k`]). Opt-in: on
    /// the H200 the one 27B shape it switches (17408 × 5120) measured slower under stream-K than
    /// under `gemv_pipe` for every dtype (bf16 T = 1: 83% against 93% of HBM, graph-timed;
    /// docs/benchmarks.md, session 6).
    Auto,
    /// Stream-K wherever the kernel can run the shape (at least one work item per warp).
    On,
    /// Always `gemv_pipe`. The default.
    Off,
}

impl GemvSk {
    /// The mode an environment value selects (unset or unknown: [`GemvSk::Off`]).
    pub fn parse(v: Option<&str>) -> Self {
        match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
            Some("on" | "1") => GemvSk::On,
            Some("auto") => GemvSk::Auto,
            _ => GemvSk::Off,
        }
    }

    /// [`GEMV_SK_ENV`], read once.
    pub(crate) fn from_env() -> Self {
        static V: std::sync::OnceLock<GemvSk> = std::sync::OnceLock::new();
        *V.get_or_init(|| Self::parse(std::env::var(GEMV_SK_ENV).ok().as_deref()))
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            GemvSk::Auto => 0,
            GemvSk::On => 1,
            GemvSk::Off => 2,
        }
    }

    pub(crate) fn from_code(c: u8) -> Self {
        match c {
            1 => GemvSk::On,
            2 => GemvSk::Off,
            _ => GemvSk::Auto,
        }
    }
}

/// The stream-K decomposition of one weight on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SkSplit {
    /// Blocks of the grid ([`GV_WARPS`] warps each).
    pub(crate) blocks: u32,
    /// 8-row units (`ceil(n / 8)`), one counter each.
    pub(crate) units: usize,
    /// Trips per unit (`ceil(chunks per row / 32)`).
    pub(crate) trips: usize,
}

impl SkSplit {
    /// Warps of the grid.
    pub(crate) fn warps(&self) -> usize {
        self.blocks as usize * GV_WARPS
    }
    /// Work items (unit, trip).
    pub(crate) fn work(&self) -> usize {
        self.units * self.trips
    }
    /// Bytes of scratch the launch needs.
    pub(crate) fn scratch_bytes(&self) -> usize {
        self.warps() * SK_SLOTS_PER_WARP * SK_SLOT_FLOATS * 4
    }
    /// Bytes of counters the launch needs.
    pub(crate) fn counter_bytes(&self) -> usize {
        self.units * 4
    }
}

/// The weight dtypes linear.cu has stream-K instances for (the q4_g128 SIMT path keeps
/// `gemv_pipe`).
pub const STREAM_K_DTYPES: [WeightDType; 5] = [
    WeightDType::F32,
    WeightDType::F16,
    WeightDType::Bf16,
    WeightDType::Q8_0,
    WeightDType::F8E4M3,
];

/// Whether linear.cu has stream-K instances for `d`.
fn has_instances(d: WeightDType) -> bool {
    STREAM_K_DTYPES.contains(&d)
}

/// The stream-K split of an `[n, k]` weight of `d` on `sms` multiprocessors: `sms ·
/// SK_BLOCKS_PER_SM` blocks. `None` when the SM count is unknown, the rows are not whole 16-byte
/// chunks, the items number 2^31 or more, or fewer than the warps (every warp must own at least
/// one item: the fix-up counts the warps between a unit's first and last owner).
pub(crate) fn sk_split(d: WeightDType, n: usize, k: usize, sms: usize) -> Option<SkSplit> {
    if !has_instances(d) || sms == 0 || n == 0 || k == 0 || k % chunk_elems(d) != 0 {
        return None;
    }
    let units = n.div_ceil(SK_UNIT_ROWS);
    let trips = (k / chunk_elems(d)).div_ceil(TRIP_CHUNKS);
    let work = units.checked_mul(trips)?;
    let blocks = sms.checked_mul(SK_BLOCKS_PER_SM)?;
    if work >= 1 << 31 || work < blocks * GV_WARPS {
        return None;
    }
    Some(SkSplit {
        blocks: u32::try_from(blocks).ok()?,
        units,
        trips,
    })
}

/// Share of `gemv_pipe`'s T = 1 time lost to its last, partly filled wave: with `B` blocks over
/// `sms × 4` resident slots, `waves = B / slots`; the busiest SM runs `ceil(waves)` rounds
/// against a mean of `waves`, so the loss is `1 - waves / ceil(waves)`. Under one wave nothing is
/// lost (every block starts at once; fewer blocks per SM each get more bandwidth).
pub(crate) fn pipe_tail_loss(d: WeightDType, n: usize, k: usize, sms: usize) -> f64 {
    if sms == 0 {
        return 0.0;
    }
    let split = gemv_split(d, n, k, sms) as usize;
    let blocks = n.div_ceil(ROWS_PER_TEAM[0] * (GV_WARPS / split));
    let waves = blocks as f64 / (sms * PIPE_T1_BLOCKS_PER_SM) as f64;
    if waves <= 1.0 {
        0.0
    } else {
        1.0 - waves / waves.ceil()
    }
}

/// The rule: the stream-K split for this weight under `mode`, or `None` for `gemv_pipe`.
/// [`GemvSk::Auto`]: stream-K when `gemv_pipe` loses more than [`MAX_TAIL_LOSS`] to its tail
/// ([`pipe_tail_loss`]) and every warp gets at least [`MIN_ITEMS_PER_WARP`] items.
pub(crate) fn use_stream_k(
    d: WeightDType,
    n: usize,
    k: usize,
    sms: usize,
    mode: GemvSk,
) -> Option<SkSplit> {
    let s = sk_split(d, n, k, sms)?;
    match mode {
        GemvSk::Off => None,
        GemvSk::On => Some(s),
        GemvSk::Auto => (s.work() >= MIN_ITEMS_PER_WARP * s.warps()
            && pipe_tail_loss(d, n, k, sms) > MAX_TAIL_LOSS)
            .then_some(s),
    }
}

#[cfg(test)]
mod tests {
    use super::super::streamk::{owner, start};
    use super::*;

    const SK_DTYPES: [WeightDType; 5] = STREAM_K_DTYPES;

    #[test]
    fn env_values_parse() {
        assert_eq!(GemvSk::parse(None), GemvSk::Off);
        assert_eq!(GemvSk::parse(Some("auto")), GemvSk::Auto);
        assert_eq!(GemvSk::parse(Some(" ON ")), GemvSk::On);
        assert_eq!(GemvSk::parse(Some("off")), GemvSk::Off);
        assert_eq!(GemvSk::parse(Some("bogus")), GemvSk::Off);
        for m in [GemvSk::Auto, GemvSk::On, GemvSk::Off] {
            assert_eq!(GemvSk::from_code(m.code()), m);
        }
    }

    #[test]
    fn auto_takes_stream_k_for_the_poorly_filled_tail_only() {
        let bf = WeightDType::Bf16;
        // 17408 x 5120: 2,176 blocks of 8 rows over 528 slots = 4.12 waves, 18% lost.
        let loss = pipe_tail_loss(bf, 17408, 5120, 132);
        assert!(
            (loss - (1.0 - 2176.0 / 528.0 / 5.0)).abs() < 1e-12,
            "{loss}"
        );
        let s = use_stream_k(bf, 17408, 5120, 132, GemvSk::Auto).expect("stream-K");
        assert_eq!(
            s,
            SkSplit {
                blocks: 528,
                units: 2176,
                trips: 20
            }
        );
        // lm_head: 14.7 waves, 2% lost; down projection and 12288 rows: under one wave.
        assert!(pipe_tail_loss(bf, 248_320, 5120, 132) < MAX_TAIL_LOSS);
        assert_eq!(use_stream_k(bf, 248_320, 5120, 132, GemvSk::Auto), None);
        assert_eq!(pipe_tail_loss(bf, 5120, 17408, 132), 0.0);
        assert_eq!(use_stream_k(bf, 5120, 17408, 132, GemvSk::Auto), None);
        assert_eq!(use_stream_k(bf, 12288, 5120, 132, GemvSk::Auto), None);
        // Unknown SM count: never.
        assert_eq!(use_stream_k(bf, 17408, 5120, 0, GemvSk::Auto), None);
        assert_eq!(use_stream_k(bf, 17408, 5120, 0, GemvSk::On), None);
        // Off: never; On: whenever the kernel can run it.
        assert_eq!(use_stream_k(bf, 17408, 5120, 132, GemvSk::Off), None);
        assert!(use_stream_k(bf, 12288, 5120, 132, GemvSk::On).is_some());
        // q4_g128 has no stream-K SIMT instances.
        for m in [GemvSk::Auto, GemvSk::On] {
            assert_eq!(use_stream_k(WeightDType::Q4G128, 17408, 5120, 132, m), None);
            assert_eq!(
                use_stream_k(WeightDType::Q4NlG128, 17408, 5120, 132, m),
                None
            );
        }
    }

    #[test]
    fn auto_needs_two_items_per_warp() {
        // Whatever the shape, Auto only takes stream-K with at least 2 items per warp and a
        // tail loss above the threshold.
        let bf = WeightDType::Bf16;
        let sms = 132;
        for n in (8..40_000).step_by(8) {
            for k in [512, 1024, 2048, 5120] {
                if let Some(s) = use_stream_k(bf, n, k, sms, GemvSk::Auto) {
                    assert!(s.work() >= MIN_ITEMS_PER_WARP * s.warps(), "{n}x{k}");
                    assert!(pipe_tail_loss(bf, n, k, sms) > MAX_TAIL_LOSS);
                }
            }
        }
        // 1,320 rows of 512 bf16 (64 chunks = 2 trips): 165 units x 2 = 330 items over 2,112
        // warps, not even one each: not even `on` runs it.
        assert_eq!(use_stream_k(bf, 1320, 512, sms, GemvSk::On), None);
    }

    #[test]
    fn rule_ignores_t_by_construction() {
        // The rule has no T argument; the split it returns sizes every instance's launch.
        for d in SK_DTYPES {
            let a = use_stream_k(d, 17408, 5120, 132, GemvSk::On).expect("split");
            assert_eq!(a.blocks as usize, 132 * SK_BLOCKS_PER_SM);
            assert_eq!(a.trips, (5120 / chunk_elems(d)).div_ceil(32));
        }
    }

    #[test]
    fn split_needs_whole_chunks_and_enough_items() {
        let bf = WeightDType::Bf16;
        assert!(sk_split(bf, 17408, 5120, 132).is_some());
        assert_eq!(sk_split(bf, 17408, 5124, 132), None);
        assert_eq!(sk_split(bf, 0, 5120, 132), None);
        assert_eq!(sk_split(bf, 8, 5120, 132), None);
        // Exactly one item per warp is the least the kernel accepts.
        let s = sk_split(bf, 8 * 2112, 256, 132).expect("one item per warp");
        assert_eq!(s.work(), s.warps());
        assert_eq!(sk_split(bf, 8 * 2111, 256, 132), None);
    }

    /// Mirrors gemv_sk's split (qp_start / qp_owner, slots, the fix-up count) on shapes that share
    /// units between warps, odd N and ragged last trips: every item is covered exactly once; a
    /// unit's contributors are the consecutive warps owner(first item) ..= owner(last item), each
    /// holding part of it; a warp shares at most its first and its last unit (its two slots; the
    /// finisher's slot rule finds each writer's slot); exactly one warp finishes each shared unit
    /// (the count completes once), and a unit is never both stored whole and fixed up.
    #[test]
    fn stream_k_split_covers_every_item_once_and_finishes_every_unit_once() {
        let mut shared_seen = 0usize;
        for d in SK_DTYPES {
            for &(n, k, sms) in &[
                (17408, 5120, 132),
                (1000, 4096, 132),
                (1001, 4096, 132),
                (1000, 4096, 7),
                (70, 4096, 1),
                (4133, 1152, 3),
                (12288, 5120, 132),
                (37, 2048, 2),
            ] {
                let Some(s) = sk_split(d, n, k, sms) else {
                    continue;
                };
                let (warps, work, tr) = (s.warps(), s.work(), s.trips);
                assert_eq!(s.units, n.div_ceil(8));
                let mut covered = vec![0u8; work];
                // Per unit: contributors (warp, slot) in warp order, and whole-unit stores.
                let mut parts: Vec<Vec<(usize, usize)>> = vec![Vec::new(); s.units];
                let mut whole = vec![0u32; s.units];
                for w in 0..warps {
                    let (i0, i1) = (start(w, warps, work), start(w + 1, warps, work));
                    assert!(i1 > i0, "{d} {n}x{k}: warp {w} empty");
                    let first = i0 / tr;
                    for (i, c) in covered.iter_mut().enumerate().take(i1).skip(i0) {
                        assert_eq!(owner(i, warps, work), w, "{d} {n}x{k} item {i}");
                        *c += 1;
                    }
                    for u in first..=(i1 - 1) / tr {
                        let (ub, ue) = (u * tr, u * tr + tr);
                        if ub >= i0 && ue <= i1 {
                            whole[u] += 1;
                        } else {
                            let slot = usize::from(u != first);
                            assert!(
                                u == first || u == (i1 - 1) / tr,
                                "{d} {n}x{k}: warp {w} shares a middle unit {u}"
                            );
                            parts[u].push((w, slot));
                        }
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{d} {n}x{k}");
                for u in 0..s.units {
                    let (w0, w1) = (
                        owner(u * tr, warps, work),
                        owner(u * tr + tr - 1, warps, work),
                    );
                    if w0 == w1 {
                        assert_eq!((whole[u], parts[u].len()), (1, 0), "{d} {n}x{k} unit {u}");
                        continue;
                    }
                    shared_seen += 1;
                    assert_eq!(whole[u], 0, "{d} {n}x{k} unit {u}");
                    // Contributors: exactly w0..=w1, in order; the kernel's reader slot rule
                    // (slot 0 iff the unit is the warp's first) matches each writer's slot.
                    let ws: Vec<usize> = parts[u].iter().map(|p| p.0).collect();
                    assert_eq!(ws, (w0..=w1).collect::<Vec<_>>(), "{d} {n}x{k} unit {u}");
                    for &(w, slot) in &parts[u] {
                        let reader_slot = usize::from(u != start(w, warps, work) / tr);
                        assert_eq!(slot, reader_slot);
                    }
                    // Arrival counting: the contributors number exactly w1 - w0 + 1 (checked
                    // above), so whatever the arrival order exactly one (the last) sees the count
                    // `prev == w1 - w0` and finishes; the others see less.
                    assert_eq!(parts[u].len(), w1 - w0 + 1);
                }
            }
        }
        assert!(
            shared_seen > 1000,
            "the shapes must share units: {shared_seen}"
        );
    }
}
