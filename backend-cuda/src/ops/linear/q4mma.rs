//! The tensor-core q4_g128 decode GEMV (`kernels/src/cu/gemv_mma.cu`): plan, path switch and
//! launch. `gemv_q4mma_xprep` lays x out as split bf16 (hi + lo) in the MMA fragment order, then
//! `gemv_q4mma_m{1,2,4}` (8 warps per block, 16·MT rows, the 128-groups of K interleaved over the
//! warps) multiplies. The plan depends on N, K and the SM count only, never on T, and each token
//! is its own MMA column, so row t of a T-row call equals a 1-row call bit for bit.
//!
//! Opt-in: `KVSTREAM_Q4_GEMV=mma` (or [`CudaBackend::set_q4_gemv`]); the default stays on the SIMT
//! kernels of linear.cu, which measured faster at T = 1 on the H200 (docs/benchmarks.md,
//! "session 4"; the tensor-core kernel wins at T = 4). The path must not depend on T: rows of a
//! T-row call must equal 1-row calls bit for bit, and the two kernels round differently.

use crate::launch::args;
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Environment variable choosing the q4_g128 decode GEMV: `auto` (or unset) picks per weight shape
/// ([`Q4Gemv::Auto`]); `mma` takes the tensor-core kernel where the shape allows, `mmap` its
/// persistent variant ([`super::q4mmap`]); `simt` the SIMT kernels.
pub const Q4_GEMV_ENV: &str = "KVSTREAM_Q4_GEMV";

/// Warps per block (`QM_WARPS` in gemv_mma.cu).
const QM_WARPS: usize = 8;
/// Values per scale group (and per warp work unit) of q4_g128.
const GROUP: usize = 128;
/// Threads per block of `gemv_q4mma_xprep`.
const XPREP_THREADS: u32 = 256;

/// Which kernel computes a q4_g128 matmul of at most 8 rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4Gemv {
    /// Tensor cores (mma.m16n8k16, split-bf16 x, exact codes, f32 accumulation).
    Mma,
    /// The same products in the persistent kernel (`gemv_q4mmap`: teams of warps stream their
    /// (tile, group) items without pause; see [`super::q4mmap`]).
    MmaPersistent,
    /// The SIMT kernels of linear.cu (f32 x, f32 FMA).
    Simt,
    /// Per weight shape (never per T, so rows of a verification call still equal single steps):
    /// the persistent tensor-core kernel for weights of at least [`AUTO_MMAP_MIN_ROWS`] rows
    /// (MLP gate/up, lm_head: on the H200 as fast as SIMT or faster at T = 1 and 2× faster at
    /// T = 4), the SIMT kernels below (down projection and the narrower weights, where SIMT wins
    /// at T = 1). The default.
    Auto,
}

/// Path state of one backend (initialised from [`Q4_GEMV_ENV`]).
#[derive(Debug)]
pub(crate) struct Q4GemvState {
    path: AtomicU8,
    /// Whether `gemv_q4mmap_xs` may already take its largest dynamic shared memory.
    pub(crate) xs_reserved: AtomicBool,
    /// The persistent kernel's fix-up buffers.
    pub(crate) buffers: std::sync::Mutex<super::q4mmap::MmapBuffers>,
}

impl Q4GemvState {
    pub(crate) fn from_env() -> Self {
        Self {
            path: AtomicU8::new(code(selects(std::env::var(Q4_GEMV_ENV).ok().as_deref()))),
            xs_reserved: AtomicBool::new(false),
            buffers: std::sync::Mutex::new(super::q4mmap::MmapBuffers::default()),
        }
    }
}

/// Fewest output rows for which [`Q4Gemv::Auto`] takes the persistent tensor-core kernel.
pub const AUTO_MMAP_MIN_ROWS: usize = 16_384;

/// The path an environment value selects (unset or unknown: [`Q4Gemv::Auto`]).
fn selects(v: Option<&str>) -> Q4Gemv {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("mma") => Q4Gemv::Mma,
        Some("mmap") => Q4Gemv::MmaPersistent,
        Some("simt") => Q4Gemv::Simt,
        _ => Q4Gemv::Auto,
    }
}

fn code(p: Q4Gemv) -> u8 {
    match p {
        Q4Gemv::Simt => 0,
        Q4Gemv::Mma => 1,
        Q4Gemv::MmaPersistent => 2,
        Q4Gemv::Auto => 3,
    }
}

fn from_code(c: u8) -> Q4Gemv {
    match c {
        0 => Q4Gemv::Simt,
        1 => Q4Gemv::Mma,
        2 => Q4Gemv::MmaPersistent,
        _ => Q4Gemv::Auto,
    }
}

impl Q4Gemv {
    /// The kernel family this path runs for a weight of `n` output rows (Auto resolved).
    pub fn for_rows(self, n: usize) -> Q4Gemv {
        match self {
            Q4Gemv::Auto if n >= AUTO_MMAP_MIN_ROWS => Q4Gemv::MmaPersistent,
            Q4Gemv::Auto => Q4Gemv::Simt,
            p => p,
        }
    }
}

/// One tensor-core GEMV launch: the instance and its grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Q4MmaPlan {
    pub(crate) name: &'static str,
    /// m-tiles of 16 rows per block.
    pub(crate) mt: usize,
    pub(crate) blocks: u32,
}

/// The plan for `[n, k]` q4_g128 codes at `w_ptr` with scales at byte `soff` on `sms`
/// multiprocessors (0: unknown), or `None` when the shape does not suit the kernel (K not a
/// multiple of 128, unaligned codes or scales, too many rows). MT minimises the rows of the
/// busiest SM, `ceil(blocks / sms) · 16·MT` (ties: the larger MT, which reads x fewer times).
pub(crate) fn q4_mma_plan(
    n: usize,
    k: usize,
    w_ptr: u64,
    soff: u64,
    sms: usize,
) -> Option<Q4MmaPlan> {
    if n == 0 || k == 0 || k % GROUP != 0 || w_ptr % 16 != 0 || soff % 2 != 0 {
        return None;
    }
    let sms = sms.max(1);
    let mut best: Option<(usize, usize)> = None; // (busiest-SM rows, mt)
    for mt in [1usize, 2, 4] {
        let blocks = n.div_ceil(16 * mt);
        let busiest = blocks.div_ceil(sms) * 16 * mt;
        if best.is_none_or(|(b, _)| busiest <= b) {
            best = Some((busiest, mt));
        }
    }
    let (_, mt) = best?;
    let blocks = u32::try_from(n.div_ceil(16 * mt)).ok()?;
    if blocks > i32::MAX as u32 {
        return None;
    }
    let name = match mt {
        1 => "gemv_q4mma_m1",
        2 => "gemv_q4mma_m2",
        _ => "gemv_q4mma_m4",
    };
    Some(Q4MmaPlan { name, mt, blocks })
}

impl CudaBackend {
    /// The q4_g128 decode GEMV path now.
    pub fn q4_gemv(&self) -> Q4Gemv {
        from_code(self.q4_gemv.path.load(Ordering::Relaxed))
    }

    /// Chooses the q4_g128 decode GEMV (overrides `KVSTREAM_Q4_GEMV`). Choose before decoding a
    /// session: MTP verification rows equal single-step rows only on one path.
    pub fn set_q4_gemv(&self, path: Q4Gemv) {
        self.q4_gemv.path.store(code(path), Ordering::Relaxed);
    }

    /// Split-bf16 x in the MMA fragment order (`gemv_q4mma_xprep`): 4 bytes per value, the size
    /// of x itself.
    pub(crate) fn q4_mma_xprep(
        &self,
        x: &CudaTensor,
        t: usize,
        k: usize,
    ) -> Result<CudaTensor, OpError> {
        let xf = self.tensor_uninit(&[t, k])?;
        let units = (t * k / 8) as u64;
        let blocks = u32::try_from(units.div_ceil(XPREP_THREADS as u64))
            .map_err(|_| OpError::shape("matmul", format!("{t} x {k} activations is too many")))?;
        let (xp, xfp) = (x.ptr(), xf.ptr());
        let (t32, k64) = (t as i32, k as u64);
        let f = self.func("gemv_q4mma_xprep")?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (XPREP_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = args![&xp, &xfp, &t32, &k64];
        self.launch("gemv", f, cfg, &mut a)?;
        Ok(xf)
    }

    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` on the tensor cores (`t` ≤ 8).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv_q4_mma(
        &self,
        plan: Q4MmaPlan,
        x: &CudaTensor,
        w_ptr: u64,
        soff: u64,
        y: &CudaTensor,
        t: usize,
        n: usize,
        k: usize,
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("gemv_q4_mma", t, n, k, mt = plan.mt).entered();
        let xf = self.q4_mma_xprep(x, t, k)?;
        let (xfp, yp) = (xf.ptr(), y.ptr());
        let (t32, k64, n64) = (t as i32, k as u64, n as u64);
        let f = self.func(plan.name)?;
        let cfg = LaunchConfig {
            grid_dim: (plan.blocks, 1, 1),
            block_dim: ((QM_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = args![&xfp, &w_ptr, &yp, &t32, &k64, &n64, &soff];
        self.launch("gemv", f, cfg, &mut a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values_select_their_path() {
        assert_eq!(selects(Some("mma")), Q4Gemv::Mma);
        assert_eq!(selects(Some(" MMA ")), Q4Gemv::Mma);
        assert_eq!(selects(Some("mmap")), Q4Gemv::MmaPersistent);
        assert_eq!(selects(Some("simt")), Q4Gemv::Simt);
        assert_eq!(selects(Some("auto")), Q4Gemv::Auto);
        assert_eq!(selects(Some("")), Q4Gemv::Auto);
        assert_eq!(selects(Some("tensor")), Q4Gemv::Auto);
        assert_eq!(selects(None), Q4Gemv::Auto);
        for p in [
            Q4Gemv::Simt,
            Q4Gemv::Mma,
            Q4Gemv::MmaPersistent,
            Q4Gemv::Auto,
        ] {
            assert_eq!(from_code(code(p)), p);
        }
    }

    #[test]
    fn auto_depends_on_the_rows_only() {
        // The 27B shapes: MLP gate/up (17,408 rows) and lm_head on tensor cores; down projection
        // (5,120 rows) and 12,288-row weights on SIMT.
        assert_eq!(Q4Gemv::Auto.for_rows(17_408), Q4Gemv::MmaPersistent);
        assert_eq!(Q4Gemv::Auto.for_rows(248_320), Q4Gemv::MmaPersistent);
        assert_eq!(Q4Gemv::Auto.for_rows(5_120), Q4Gemv::Simt);
        assert_eq!(Q4Gemv::Auto.for_rows(12_288), Q4Gemv::Simt);
        for p in [Q4Gemv::Simt, Q4Gemv::Mma, Q4Gemv::MmaPersistent] {
            assert_eq!(p.for_rows(7), p);
            assert_eq!(p.for_rows(1 << 20), p);
        }
    }

    #[test]
    fn plan_needs_whole_groups_and_aligned_codes() {
        assert!(q4_mma_plan(64, 1024, 0, 0, 132).is_some());
        assert!(q4_mma_plan(64, 1000, 0, 0, 132).is_none());
        assert!(q4_mma_plan(64, 1024, 8, 0, 132).is_none());
        assert!(q4_mma_plan(64, 1024, 0, 3, 132).is_none());
        assert!(q4_mma_plan(0, 1024, 0, 0, 132).is_none());
    }

    #[test]
    fn plan_covers_every_row_and_balances_the_sms() {
        for &(n, sms) in &[
            (17408, 132),
            (5120, 132),
            (12288, 132),
            (248_320, 132),
            (7, 132),
            (70, 0),
        ] {
            let p = q4_mma_plan(n, 5120, 0, 0, sms).expect("plan");
            let rows = p.blocks as usize * 16 * p.mt;
            assert!(rows >= n && rows < n + 16 * p.mt, "n={n}: {p:?}");
            assert!(kvstream_kernels::module_of(p.name).is_some(), "{}", p.name);
            assert!(p.name.ends_with(&p.mt.to_string()), "{p:?}");
        }
        // 17408 rows on 132 SMs: 1,088 blocks of 16 rows (the busiest SM holds 144 rows; 32- or
        // 64-row blocks would give it 160 or 192).
        assert_eq!(q4_mma_plan(17408, 5120, 0, 0, 132).map(|p| p.mt), Some(1));
        // 12288: 96 rows either way -> the larger tile.
        assert_eq!(q4_mma_plan(12288, 5120, 0, 0, 132).map(|p| p.mt), Some(2));
        // A tall head: 1,888 rows on the busiest SM with 16- or 32-row blocks, 1,920 with 64.
        assert_eq!(q4_mma_plan(248_320, 5120, 0, 0, 132).map(|p| p.mt), Some(2));
        // Few SMs: everything balances, the largest tile wins.
        assert_eq!(q4_mma_plan(4096, 5120, 0, 0, 1).map(|p| p.mt), Some(4));
    }

    /// Mirrors the fragment bookkeeping of gemv_mma.cu for one 128-group: lane (g, tq) loads code
    /// bytes 16·tq .. 16·tq + 16 (codes k = 32·tq + 8·w + e, nibble e of word w); at step (w, h)
    /// its A registers 0/1 hold codes (2h, 2h + 4) of word w (rows g, g + 8) in MMA slots
    /// (2tq, 2tq + 1) and registers 2/3 codes (2h + 1, 2h + 5) in slots (2tq + 8, 2tq + 9); the B
    /// fragment `gemv_q4mma_xprep` writes for (tq, w) holds x at the same codes in the same
    /// slots. Every k of the group meets its own x exactly once.
    #[test]
    fn fragment_order_pairs_each_code_with_its_x_once() {
        // xprep: unit i = 16·G + 4·tq + w → uint4 (G, j = 2w + h, tq) = {hi(a, b), hi(c, d), lo.., lo..}, with
        // (a, b, c, d) = (2h, 2h + 4, 2h + 1, 2h + 5) + 8w + 32tq (the e-indices of the kernel).
        let xprep_k = |tq: usize, w: usize, h: usize, reg: usize, half: usize| {
            let e = match (reg, half) {
                (0, 0) => 2 * h,
                (0, 1) => 2 * h + 4,
                (1, 0) => 2 * h + 1,
                _ => 2 * h + 5,
            };
            32 * tq + 8 * w + e
        };
        let mut seen = [0u8; GROUP];
        for tq in 0..4 {
            for w in 0..4 {
                for h in 0..2 {
                    // The kernel's A registers: qm_deq(v >> 4·(2h)) → nibbles (2h, 2h + 4);
                    // qm_deq(v >> 4·(2h + 1)) → (2h + 1, 2h + 5); slot pair 0 ↔ B register 0.
                    for (reg, shift) in [(0usize, 2 * h), (1, 2 * h + 1)] {
                        for half in 0..2 {
                            let nibble = shift + 4 * half;
                            let code_k = 32 * tq + 8 * w + nibble;
                            assert_eq!(code_k, xprep_k(tq, w, h, reg, half));
                            seen[code_k] += 1;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }
}
