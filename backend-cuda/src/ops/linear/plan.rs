//! Launch plans of the linear kernels (`kernels/src/cu/linear.cu`): which GEMV instance, how many
//! warps share a row (`split`) and the grid. Pure functions of the shape, so they are tested
//! without a GPU.
//!
//! T-independence: everything that decides the per-row accumulation order (vector or scalar
//! kernel, chunk size, `split`) is a function of the dtype, N and K only, never of T; T only picks
//! the instance (`_t1`, `_t4`, `_t8`), which sizes the accumulators and nothing else.

use super::sk_plan::{use_stream_k, GemvSk, SkSplit};
use kvstream_memory_contracts::backend::WeightDType;

/// Warps per vector-GEMV block (`GP_WARPS` in linear.cu); also the largest `split`.
pub(crate) const GV_WARPS: usize = 4;
/// Warps (= rows) per block of the scalar fallback GEMV.
pub(crate) const SCALAR_WARPS: usize = 8;
/// Reference rows per warp team for the `split` rule (`GV_R` in linear.cu). The split must not
/// depend on T, so it is computed with this fixed value whatever the instance's own R.
pub(crate) const GV_R: usize = 4;
/// Rows per warp team of each instance width (`_t1`, `_t4`, `_t8`: the `R` template argument of
/// the entry points in linear.cu).
pub(crate) const ROWS_PER_TEAM: [usize; 3] = [8, 8, 4];
/// Warps the split heuristic aims for (≈ 16 per SM on a 132-SM H100/H200): fewer row teams than
/// that leave SMs idle, so their rows are split over more warps.
pub(crate) const TARGET_WARPS: usize = 2048;

/// GEMV kernel names by dtype (the `dtype_code` order) and accumulator width (1, 4, 8).
const GEMV_KERNELS: [[&str; 3]; 7] = [
    ["gemv_f32_t1", "gemv_f32_t4", "gemv_f32_t8"],
    ["gemv_f16_t1", "gemv_f16_t4", "gemv_f16_t8"],
    ["gemv_bf16_t1", "gemv_bf16_t4", "gemv_bf16_t8"],
    ["gemv_q8_0_t1", "gemv_q8_0_t4", "gemv_q8_0_t8"],
    ["gemv_q4g128_t1", "gemv_q4g128_t4", "gemv_q4g128_t8"],
    ["gemv_f8e4m3_t1", "gemv_f8e4m3_t4", "gemv_f8e4m3_t8"],
    ["gemv_q4nl_t1", "gemv_q4nl_t4", "gemv_q4nl_t8"],
];

/// Stream-K GEMV kernels (`gemv_sk_*`, see [`super::sk_plan`]) by dtype and width; the 4-bit
/// formats have none.
fn sk_kernels(d: WeightDType) -> Option<[&'static str; 3]> {
    Some(match d {
        WeightDType::F32 => ["gemv_sk_f32_t1", "gemv_sk_f32_t4", "gemv_sk_f32_t8"],
        WeightDType::F16 => ["gemv_sk_f16_t1", "gemv_sk_f16_t4", "gemv_sk_f16_t8"],
        WeightDType::Bf16 => ["gemv_sk_bf16_t1", "gemv_sk_bf16_t4", "gemv_sk_bf16_t8"],
        WeightDType::Q8_0 => ["gemv_sk_q8_0_t1", "gemv_sk_q8_0_t4", "gemv_sk_q8_0_t8"],
        WeightDType::F8E4M3 => [
            "gemv_sk_f8e4m3_t1",
            "gemv_sk_f8e4m3_t4",
            "gemv_sk_f8e4m3_t8",
        ],
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => return None,
    })
}

/// The q4_g128 instances with coalesced x reads (`XC` in linear.cu), used when a warp's trip of
/// 32 chunks never runs past the row end (K a multiple of [`Q4X_K_MULTIPLE`]); a function of K
/// only, so T-independence holds.
const GEMV_Q4X_KERNELS: [&str; 3] = ["gemv_q4g128x_t1", "gemv_q4g128x_t4", "gemv_q4g128x_t8"];
/// K multiple that selects [`GEMV_Q4X_KERNELS`]: 32 lanes × 32 values per 16-byte chunk.
pub(crate) const Q4X_K_MULTIPLE: usize = 1024;

/// Elements in one 16-byte chunk of a weight row (`Fmt<..>::EPC` in linear.cu).
pub(crate) fn chunk_elems(d: WeightDType) -> usize {
    match d {
        WeightDType::F32 => 4,
        WeightDType::F16 | WeightDType::Bf16 => 8,
        WeightDType::Q8_0 | WeightDType::F8E4M3 => 16,
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => 32,
    }
}

/// How one GEMV (T ≤ 8) is launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemvPlan {
    /// The cp.async-pipelined vector kernel `name` with `split` warps per row team, `blocks`
    /// blocks of [`GV_WARPS`] warps.
    Vector {
        name: &'static str,
        split: u32,
        blocks: u32,
    },
    /// `gemv_scalar`: one warp per row, [`SCALAR_WARPS`] rows per block.
    Scalar { blocks: u32 },
    /// The persistent stream-K kernel `name` (`gemv_sk_*`) with the grid and work of `split`.
    StreamK { name: &'static str, split: SkSplit },
}

/// Warps per row team for an `[n, k]` weight of `d` on a device of `sms` multiprocessors (0:
/// unknown): the smallest power of two (≤ 4) that gives about [`TARGET_WARPS`] warps, while every
/// lane keeps at least two chunks per row; then the **balance rule**: when that leaves one warp
/// per row team, a larger split is taken if it evens out the blocks per SM (the busiest SM's
/// share, `ceil(blocks / sms) / split` in units of a whole-K block, at least 4% better per
/// doubling) — 17408 × 5120 gives 544 blocks of 32 rows, 4.1 per SM of an H200, so one SM in
/// eight holds a fifth block while the others idle. `KVSTREAM_GEMV_SPLIT` (1, 2 or 4) overrides
/// (A/B measurements). Never depends on T.
pub(crate) fn gemv_split(d: WeightDType, n: usize, k: usize, sms: usize) -> u32 {
    let teams = n.div_ceil(GV_R);
    let chunks = k / chunk_elems(d);
    let allowed = |s: usize| s <= GV_WARPS && chunks >= 32 * 2 * s;
    if let Some(forced) = split_override().filter(|&f| allowed(f)) {
        return forced as u32;
    }
    let mut s = 1usize;
    while s < GV_WARPS && teams * s < TARGET_WARPS && allowed(2 * s) {
        s *= 2;
    }
    if s == 1 && sms > 0 {
        let busiest = |s: usize| {
            let blocks = n.div_ceil(ROWS_PER_TEAM[0] * (GV_WARPS / s));
            blocks.div_ceil(sms) as f64 / s as f64 * (1.0 + 0.04 * s.ilog2() as f64)
        };
        let mut best = (busiest(1), 1);
        for cand in [2, 4] {
            if allowed(cand) && busiest(cand) < best.0 {
                best = (busiest(cand), cand);
            }
        }
        s = best.1;
    }
    s as u32
}

/// `KVSTREAM_GEMV_SPLIT`: a forced split (1, 2 or 4), read once.
fn split_override() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("KVSTREAM_GEMV_SPLIT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|v: &usize| matches!(v, 1 | 2 | 4))
    })
}

/// The GEMV plan for `t` rows (1..=8) of activations against `[n, k]` of `d` at device address
/// `w_ptr` on `sms` multiprocessors, with the stream-K kernel chosen by `sk` (see
/// [`use_stream_k`]; never a function of `t`). `None` if the grid would not fit (more than
/// 2^31 - 1 blocks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemv_plan(
    d: WeightDType,
    code: usize,
    t: usize,
    n: usize,
    k: usize,
    w_ptr: u64,
    sms: usize,
    sk: GemvSk,
) -> Option<GemvPlan> {
    let vector = k % chunk_elems(d) == 0 && w_ptr % 16 == 0;
    if !vector {
        let blocks = u32::try_from(n.div_ceil(SCALAR_WARPS)).ok()?;
        return Some(GemvPlan::Scalar { blocks });
    }
    let width = match t {
        0 | 1 => 0,
        2..=4 => 1,
        _ => 2,
    };
    if let (Some(split), Some(names)) = (use_stream_k(d, n, k, sms, sk), sk_kernels(d)) {
        let name = names[width];
        return Some(GemvPlan::StreamK { name, split });
    }
    let split = gemv_split(d, n, k, sms);
    let rows_per_block = ROWS_PER_TEAM[width] * (GV_WARPS / split as usize);
    let blocks = u32::try_from(n.div_ceil(rows_per_block)).ok()?;
    if blocks > i32::MAX as u32 {
        return None;
    }
    let name = if d == WeightDType::Q4G128 && k % Q4X_K_MULTIPLE == 0 {
        GEMV_Q4X_KERNELS[width]
    } else {
        GEMV_KERNELS.get(code)?[width]
    };
    Some(GemvPlan::Vector {
        name,
        split,
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::dtype_code;

    const ALL: [WeightDType; 7] = [
        WeightDType::F32,
        WeightDType::F16,
        WeightDType::Bf16,
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ];

    #[test]
    fn kernel_table_matches_dtype_codes_and_the_kernel_list() {
        for d in ALL {
            let code = dtype_code(d) as usize;
            for t in 1..=8 {
                let Some(GemvPlan::Vector { name, .. }) =
                    gemv_plan(d, code, t, 64, 1024, 256, 132, GemvSk::Off)
                else {
                    panic!("{d}: expected the vector kernel");
                };
                assert!(
                    kvstream_kernels::module_of(name).is_some(),
                    "{name} is not in the kernel table"
                );
                let tag = match d {
                    WeightDType::Q4G128 => "q4g128".to_string(),
                    WeightDType::F8E4M3 => "f8e4m3".to_string(),
                    WeightDType::Q4NlG128 => "q4nl_t".to_string(),
                    other => other.to_string(),
                };
                assert!(name.contains(&tag), "{d} → {name}");
            }
        }
    }

    #[test]
    fn q4_rows_of_whole_trips_take_the_coalesced_instances() {
        let d = WeightDType::Q4G128;
        let code = dtype_code(d) as usize;
        let name = |t, k| match gemv_plan(d, code, t, 64, k, 0, 132, GemvSk::Off) {
            Some(GemvPlan::Vector { name, .. }) => name,
            other => panic!("{other:?}"),
        };
        for t in 1..=8 {
            for k in [1024, 5120, 17408] {
                assert!(name(t, k).starts_with("gemv_q4g128x_"), "t={t} k={k}");
                assert!(kvstream_kernels::module_of(name(t, k)).is_some());
            }
            for k in [128, 640, 1152] {
                assert!(name(t, k).starts_with("gemv_q4g128_t"), "t={t} k={k}");
            }
        }
    }

    /// Mirrors the index arithmetic of the coalesced-x q4 path (`XC` in linear.cu) for one warp
    /// trip of 32 chunks × 32 values: lane l's chunk lands in slot l ^ ((l >> 3) & 3); lane
    /// (G, q) = (l / 4, l % 4) reads, at step i, the 2-byte sub-word q + 4 (i & 1) of slot
    /// s(4G + i / 2) and the x float4 32G + q + 4i. Every value is read exactly once, the weight
    /// and x indices agree, every value is in the lane's own scale group (its staged scale), and
    /// each step's 32 shared-memory reads hit distinct banks (or share a word).
    #[test]
    fn coalesced_q4_lane_mapping_covers_each_value_once() {
        let slot = |c: usize| c ^ ((c >> 3) & 3);
        let mut chunk_of_slot = [usize::MAX; 32];
        for l in 0..32 {
            chunk_of_slot[slot(l)] = l;
        }
        assert!(
            chunk_of_slot.iter().all(|&c| c < 32),
            "swizzle is a bijection"
        );
        let mut seen = [0u8; 1024];
        for i in 0..8usize {
            let mut banks: std::collections::HashMap<usize, usize> = Default::default();
            for lane in 0..32usize {
                let (g, q) = (lane >> 2, lane & 3);
                let s = slot(4 * g + (i >> 1));
                let hw = q + 4 * (i & 1);
                let first = 32 * chunk_of_slot[s] + 4 * hw;
                assert_eq!(first, 4 * (32 * g + q + 4 * i), "lane {lane} step {i}");
                assert_eq!(first / 128, g, "lane {lane}: outside its scale group");
                for n in &mut seen[first..first + 4] {
                    *n += 1;
                }
                let word = (s * 16 + 2 * hw) / 4;
                let other = banks.insert(word % 32, word);
                assert!(other.is_none_or(|w| w == word), "step {i}: bank conflict");
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
    }

    #[test]
    fn split_ignores_t_and_blocks_cover_every_row() {
        for (d, sms) in ALL.into_iter().flat_map(|d| [(d, 0), (d, 132), (d, 70)]) {
            let code = dtype_code(d) as usize;
            for &(n, k) in &[
                (5120, 17408),
                (17408, 5120),
                (96, 256),
                (7, 4096),
                (248_320, 5120),
            ] {
                let strip = |p: Option<GemvPlan>| match p {
                    Some(GemvPlan::Vector { split, blocks, .. }) => (split, blocks),
                    other => panic!("{other:?}"),
                };
                let (split1, _) = strip(gemv_plan(d, code, 1, n, k, 0, sms, GemvSk::Off));
                for t in 1..=8 {
                    let (split, blocks) = strip(gemv_plan(d, code, t, n, k, 0, sms, GemvSk::Off));
                    assert_eq!(split, split1, "{d} [{n}x{k}] t={t}: split depends on T");
                    let width = usize::from(t > 1) + usize::from(t > 4);
                    let per_block = ROWS_PER_TEAM[width] * GV_WARPS / split as usize;
                    let rows = blocks as usize * per_block;
                    assert!(rows >= n && rows < n + per_block, "{d} [{n}x{k}] t={t}");
                }
            }
        }
    }

    #[test]
    fn split_grows_for_few_long_rows_only() {
        assert_eq!(gemv_split(WeightDType::Bf16, 17408, 5120, 0), 1);
        assert_eq!(gemv_split(WeightDType::Bf16, 248_320, 5120, 0), 1);
        assert_eq!(gemv_split(WeightDType::Bf16, 5120, 17408, 0), 2);
        assert_eq!(gemv_split(WeightDType::Bf16, 7, 4096, 0), 4);
        // Too few chunks per lane: stays 1.
        assert_eq!(gemv_split(WeightDType::Bf16, 7, 256, 0), 1);
        for d in ALL {
            let s = gemv_split(d, 33, 1 << 16, 0);
            assert!(s.is_power_of_two() && s as usize <= GV_WARPS, "{d}: {s}");
        }
    }

    #[test]
    fn balance_rule_evens_out_blocks_per_sm() {
        // 17408 x 5120 bf16: 544 blocks of 32 rows over 132 SMs (4.1 each) -> split 4 (2,176
        // blocks of 8 rows, 16.5 per SM: the busiest SM holds 3% more than the average).
        assert_eq!(gemv_split(WeightDType::Bf16, 17408, 5120, 132), 4);
        // Well balanced or already split: unchanged.
        assert_eq!(gemv_split(WeightDType::Bf16, 248_320, 5120, 132), 1);
        assert_eq!(gemv_split(WeightDType::Bf16, 12288, 5120, 132), 1);
        assert_eq!(gemv_split(WeightDType::Bf16, 5120, 17408, 132), 2);
        // Too few chunks per lane for a split: unchanged.
        assert_eq!(gemv_split(WeightDType::Bf16, 17408, 256, 132), 1);
        // Unknown SM count: the warp-count rule alone.
        assert_eq!(gemv_split(WeightDType::Bf16, 17408, 5120, 0), 1);
    }

    /// Stream-K plans: the kernel table has every instance, the instance name follows the width
    /// and dtype, and the grid and units (the decomposition) are the same for every T.
    #[test]
    fn stream_k_plans_name_existing_kernels_and_ignore_t() {
        for d in ALL {
            let code = dtype_code(d) as usize;
            let plans: Vec<_> = (1..=8)
                .map(|t| gemv_plan(d, code, t, 17408, 5120, 0, 132, GemvSk::Auto))
                .collect();
            if d.is_q4() {
                assert!(plans
                    .iter()
                    .all(|p| matches!(p, Some(GemvPlan::Vector { .. }))));
                continue;
            }
            let mut grid = None;
            for (t, p) in (1..=8).zip(plans) {
                let Some(GemvPlan::StreamK { name, split }) = p else {
                    panic!("{d} t={t}: expected stream-K, got {p:?}");
                };
                assert!(kvstream_kernels::module_of(name).is_some(), "{name}");
                assert!(name.starts_with("gemv_sk_"), "{name}");
                let width = if t == 1 {
                    "_t1"
                } else if t <= 4 {
                    "_t4"
                } else {
                    "_t8"
                };
                assert!(name.ends_with(width), "{d} t={t}: {name}");
                let g = *grid.get_or_insert(split);
                assert_eq!(split, g, "{d} t={t}: the split depends on T");
                assert_eq!((split.blocks, split.units), (528, 2176));
            }
            // Off, or a shape gemv_pipe fills well: the pipelined kernel.
            let off = gemv_plan(d, code, 1, 17408, 5120, 0, 132, GemvSk::Off);
            assert!(matches!(off, Some(GemvPlan::Vector { .. })), "{off:?}");
            let lm = gemv_plan(d, code, 1, 248_320, 5120, 0, 132, GemvSk::Auto);
            assert!(matches!(lm, Some(GemvPlan::Vector { .. })), "{lm:?}");
            // Unaligned rows stay scalar even when forced.
            let sc = gemv_plan(d, code, 1, 17408, 5120, 8, 132, GemvSk::On);
            assert!(matches!(sc, Some(GemvPlan::Scalar { .. })), "{sc:?}");
        }
    }

    #[test]
    fn unaligned_or_ragged_rows_use_the_scalar_kernel() {
        let code = dtype_code(WeightDType::Bf16) as usize;
        assert_eq!(
            gemv_plan(WeightDType::Bf16, code, 1, 70, 200 + 4, 0, 132, GemvSk::Off),
            Some(GemvPlan::Scalar { blocks: 9 })
        );
        assert!(matches!(
            gemv_plan(WeightDType::Bf16, code, 1, 70, 200, 8, 132, GemvSk::Off),
            Some(GemvPlan::Scalar { .. })
        ));
        let f8 = dtype_code(WeightDType::F8E4M3) as usize;
        assert!(matches!(
            gemv_plan(WeightDType::F8E4M3, f8, 3, 70, 200, 0, 132, GemvSk::Off),
            Some(GemvPlan::Scalar { .. })
        ));
        assert!(matches!(
            gemv_plan(WeightDType::F8E4M3, f8, 3, 70, 208, 0, 132, GemvSk::Off),
            Some(GemvPlan::Vector { .. })
        ));
    }
}
