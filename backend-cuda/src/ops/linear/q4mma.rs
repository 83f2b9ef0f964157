//! The q4_g128 decode GEMV path switch and what the tensor-core kernel shares with it:
//! `gemv_q4mma_xprep` lays x out as split bf16 (hi + lo) in the MMA fragment order that the
//! persistent stream-K kernel ([`super::q4mmap`], `kernels/src/cu/gemv_mma.cu`) reads.
//!
//! [`Q4Gemv::Auto`] (the default) picks the tensor-core kernel or the SIMT kernels of linear.cu
//! per weight shape, never per T: rows of a T-row call must equal 1-row calls bit for bit, and
//! the two kernels round differently.

use crate::launch::args;
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Environment variable choosing the q4_g128 decode GEMV: `auto` (or unset) picks per weight shape
/// ([`Q4Gemv::Auto`]); `mmap` takes the tensor-core kernel ([`super::q4mmap`]) wherever the shape
/// allows, `simt` the SIMT kernels.
pub const Q4_GEMV_ENV: &str = "KVSTREAM_Q4_GEMV";

/// Values per scale group of q4_g128.
#[cfg(test)]
const GROUP: usize = 128;
/// Threads per block of `gemv_q4mma_xprep`.
const XPREP_THREADS: u32 = 256;

/// Which kernel computes a q4_g128 matmul of at most 8 rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Q4Gemv {
    /// Tensor cores (mma.m16n8k16, split-bf16 x, exact codes, f32 accumulation) in the persistent
    /// stream-K kernel (`gemv_q4mmap*`, see [`super::q4mmap`]).
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
}

impl Q4GemvState {
    pub(crate) fn from_env() -> Self {
        Self {
            path: AtomicU8::new(code(selects(std::env::var(Q4_GEMV_ENV).ok().as_deref()))),
            xs_reserved: AtomicBool::new(false),
        }
    }
}

/// Fewest output rows for which [`Q4Gemv::Auto`] takes the persistent tensor-core kernel.
pub const AUTO_MMAP_MIN_ROWS: usize = 16_384;

/// The path an environment value selects (unset or unknown: [`Q4Gemv::Auto`]).
fn selects(v: Option<&str>) -> Q4Gemv {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("mmap") => Q4Gemv::MmaPersistent,
        Some("simt") => Q4Gemv::Simt,
        _ => Q4Gemv::Auto,
    }
}

fn code(p: Q4Gemv) -> u8 {
    match p {
        Q4Gemv::Simt => 0,
        Q4Gemv::MmaPersistent => 1,
        Q4Gemv::Auto => 2,
    }
}

fn from_code(c: u8) -> Q4Gemv {
    match c {
        0 => Q4Gemv::Simt,
        1 => Q4Gemv::MmaPersistent,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values_select_their_path() {
        assert_eq!(selects(Some("mmap")), Q4Gemv::MmaPersistent);
        assert_eq!(selects(Some(" MMAP ")), Q4Gemv::MmaPersistent);
        assert_eq!(selects(Some("mma")), Q4Gemv::Auto);
        assert_eq!(selects(Some("simt")), Q4Gemv::Simt);
        assert_eq!(selects(Some("auto")), Q4Gemv::Auto);
        assert_eq!(selects(Some("")), Q4Gemv::Auto);
        assert_eq!(selects(Some("tensor")), Q4Gemv::Auto);
        assert_eq!(selects(None), Q4Gemv::Auto);
        for p in [Q4Gemv::Simt, Q4Gemv::MmaPersistent, Q4Gemv::Auto] {
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
        for p in [Q4Gemv::Simt, Q4Gemv::MmaPersistent] {
            assert_eq!(p.for_rows(7), p);
            assert_eq!(p.for_rows(1 << 20), p);
        }
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
