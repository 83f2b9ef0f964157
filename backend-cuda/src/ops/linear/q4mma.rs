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
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

/// Environment variable choosing the q4_g128 decode GEMV: `auto` (or unset) picks per weight shape
/// ([`Q4Gemv::Auto`]); `mmap` takes the split-bf16 tensor-core kernel ([`super::q4mmap`]) wherever
/// the shape allows, `i8` the integer tensor-core kernel, `simt` the SIMT kernels.
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
    /// Tensor cores on integers (mma.m16n8k32.u8.s8: the stored nibbles times x rounded per
    /// 128-group to 22 bits (power-of-two scale) in three bytes, exact int32 sums) in the same persistent
    /// stream-K kernel (`gemv_q4i8p*`, see [`super::q4mmap`]).
    Int8,
    /// The integer tensor-core kernel with the three bytes of x packed into the MMA's B columns
    /// (`gemv_q4i8c*`, see [`super::q4mmap`]): one mma.m16n8k32 per 32 codes of a 2-token pair
    /// instead of three.
    Int8Cols,
    /// The SIMT kernels of linear.cu (f32 x, f32 FMA).
    Simt,
    /// The column-packed integer tensor-core kernel wherever its plan exists (K a multiple of
    /// 128, aligned codes, at least 8 warps of work), the SIMT kernels elsewhere: on the H200 the
    /// fastest path on every 27B shape at T = 1 and T = 4 (docs/benchmarks.md, session 9; the
    /// three-MMA integer kernel was the default since session 6). The default.
    Auto,
}

/// Path state of one backend (initialised from [`Q4_GEMV_ENV`]).
#[derive(Debug)]
pub(crate) struct Q4GemvState {
    path: AtomicU8,
    /// Bit i set: the i-th staged (`_xs`) persistent kernel (`super::q4mmap::STAGED_KERNELS`)
    /// may already take its largest dynamic shared memory.
    pub(crate) xs_reserved: AtomicU32,
    /// Bit i set: the i-th tile-owning build (`super::q4tiles`) may take its shared memory.
    pub(crate) tiles_reserved: AtomicU32,
    /// Which shapes run the tile-owning kernel (`super::q4tiles::Q4Tiles::code`).
    pub(crate) tiles: std::sync::atomic::AtomicU64,
    /// Whether the tile-owning kernel's block ranges are equal runs of stages
    /// (`super::q4tiles::Q4_TILES_SPLIT_ENV`).
    pub(crate) tiles_split: std::sync::atomic::AtomicBool,
}

impl Q4GemvState {
    pub(crate) fn from_env() -> Self {
        Self {
            path: AtomicU8::new(code(selects(std::env::var(Q4_GEMV_ENV).ok().as_deref()))),
            xs_reserved: AtomicU32::new(0),
            tiles_reserved: AtomicU32::new(0),
            tiles: std::sync::atomic::AtomicU64::new(super::q4tiles::Q4Tiles::from_env().code()),
            tiles_split: std::sync::atomic::AtomicBool::new(
                std::env::var(super::q4tiles::Q4_TILES_SPLIT_ENV).is_ok_and(|v| v.trim() == "1"),
            ),
        }
    }
}

/// Lets kernel `name` (`f`) take `bytes` of dynamic shared memory (the opt-in beyond 48 KiB),
/// once: bit `bit` of `done` records it (the q4 GEMV launchers' per-build masks in
/// [`Q4GemvState`]). A refusal is a capability error naming the kernel.
pub(crate) fn reserve_smem_once(
    f: &cudarc::driver::CudaFunction,
    name: &'static str,
    bytes: usize,
    done: &AtomicU32,
    bit: u32,
) -> Result<(), OpError> {
    if done.load(Ordering::Relaxed) & bit != 0 {
        return Ok(());
    }
    crate::launch::allow_dynamic_smem(f, bytes).map_err(|r| {
        OpError::Capability(kvstream_memory_contracts::CapabilityError::new(
            "cuda",
            name,
            format!("cannot reserve {bytes} bytes of shared memory: {r:?}"),
        ))
    })?;
    done.fetch_or(bit, Ordering::Relaxed);
    Ok(())
}

/// The path an environment value selects (unset or unknown: [`Q4Gemv::Auto`]).
fn selects(v: Option<&str>) -> Q4Gemv {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("mmap") => Q4Gemv::MmaPersistent,
        Some("simt") => Q4Gemv::Simt,
        Some("i8") => Q4Gemv::Int8,
        Some("i8c") => Q4Gemv::Int8Cols,
        _ => Q4Gemv::Auto,
    }
}

fn code(p: Q4Gemv) -> u8 {
    match p {
        Q4Gemv::Simt => 0,
        Q4Gemv::MmaPersistent => 1,
        Q4Gemv::Auto => 2,
        Q4Gemv::Int8 => 3,
        Q4Gemv::Int8Cols => 4,
    }
}

fn from_code(c: u8) -> Q4Gemv {
    match c {
        0 => Q4Gemv::Simt,
        1 => Q4Gemv::MmaPersistent,
        3 => Q4Gemv::Int8,
        4 => Q4Gemv::Int8Cols,
        _ => Q4Gemv::Auto,
    }
}

impl Q4Gemv {
    /// The kernel family this path tries first (Auto resolved; every tensor-core path falls back
    /// to SIMT where its plan does not exist). A function of the path alone, never of T or of the
    /// weight's shape beyond that plan.
    pub fn resolved(self) -> Q4Gemv {
        match self {
            Q4Gemv::Auto => Q4Gemv::Int8Cols,
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

impl CudaBackend {
    /// x rounded per (token, 128-group) to 22-bit integers (power-of-two scale) split into three
    /// signed bytes, in the integer MMA fragment order of `kernel` (`gemv_q4i8_xprep` for
    /// q4_g128, `gemv_q4nl_i8_xprep` for q4_nl_g128: [`I8_XPREP_BYTES_PER_GROUP`]; the
    /// column-packed `gemv_q4i8c_xprep` / `gemv_q4nl_i8c_xprep`: [`I8C_XPREP_BYTES_PER_GROUP`]
    /// per group and token).
    pub(crate) fn q4_i8_xprep(
        &self,
        x: &CudaTensor,
        t: usize,
        k: usize,
        kernel: &'static str,
        bytes_per_group: usize,
    ) -> Result<CudaTensor, OpError> {
        let groups = t * (k / 128);
        let xf = self.tensor_uninit(&[groups, bytes_per_group / 4])?;
        // One warp per (token, group).
        let blocks = u32::try_from((groups as u64 * 32).div_ceil(XPREP_THREADS as u64))
            .map_err(|_| OpError::shape("matmul", format!("{t} x {k} activations is too many")))?;
        let (xp, xfp) = (x.ptr(), xf.ptr());
        let (t32, k64) = (t as i32, k as u64);
        let f = self.func(kernel)?;
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

/// Bytes `gemv_q4i8_xprep` writes per (token, 128-group): 25 uint4 (`QI_U4`).
pub(crate) const I8_XPREP_BYTES_PER_GROUP: usize = 25 * 16;
/// Bytes `gemv_q4i8c_xprep` writes per (token, 128-group): 25 uint4 (`QC_U4`).
pub(crate) const I8C_XPREP_BYTES_PER_GROUP: usize = 25 * 16;

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
        assert_eq!(selects(Some("I8")), Q4Gemv::Int8);
        assert_eq!(selects(Some("i8c")), Q4Gemv::Int8Cols);
        for p in [
            Q4Gemv::Simt,
            Q4Gemv::MmaPersistent,
            Q4Gemv::Auto,
            Q4Gemv::Int8,
            Q4Gemv::Int8Cols,
        ] {
            assert_eq!(from_code(code(p)), p);
        }
    }

    #[test]
    fn auto_resolves_to_the_integer_kernel() {
        assert_eq!(Q4Gemv::Auto.resolved(), Q4Gemv::Int8Cols);
        for p in [
            Q4Gemv::Simt,
            Q4Gemv::MmaPersistent,
            Q4Gemv::Int8,
            Q4Gemv::Int8Cols,
        ] {
            assert_eq!(p.resolved(), p);
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

    /// Mirrors `gemv_q4i8_xprep` and the integer kernel's fragments for one 128-group: xprep lane
    /// l holds k = 4l .. 4l + 3 and sends value i to (tq = l / 8, wd = (l / 2) % 4) byte
    /// j = 2·(l % 2) + i / 2 of b0 (even i) or b1 (odd i); the kernel's lane (g, tq) at step wd
    /// puts nibble 2j of its word wd (code k = 32·tq + 8·wd + 2j) in a0 byte j and nibble 2j + 1
    /// in a2 byte j, which meet b0 / b1 byte j of the same tq in the MMA. Every code meets its own
    /// x exactly once.
    #[test]
    fn integer_fragments_pair_each_code_with_its_x_once() {
        let mut x_at = std::collections::HashMap::new();
        for lane in 0..32usize {
            for i in 0..4usize {
                let (tq, wd) = (lane / 8, (lane / 2) % 4);
                let j = 2 * (lane % 2) + i / 2;
                let reg = i % 2; // 0: b0, 1: b1
                assert!(x_at.insert((tq, wd, reg, j), 4 * lane + i).is_none());
            }
        }
        let mut seen = [0u8; GROUP];
        for tq in 0..4 {
            for wd in 0..4 {
                for j in 0..4 {
                    for (reg, nibble) in [(0usize, 2 * j), (1, 2 * j + 1)] {
                        let code_k = 32 * tq + 8 * wd + nibble;
                        assert_eq!(x_at[&(tq, wd, reg, j)], code_k, "tq {tq} wd {wd} j {j}");
                        seen[code_k] += 1;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }

    /// The q4_nl_g128 variant (`gemv_q4nl_i8_xprep`, `gemv_q4nli8p*`): xprep lane l = 2m + r
    /// sends value i (k = 4l + i) to (tq = m / 4, wd = m % 4) byte i of b0 (r = 0) or b1 (r = 1);
    /// the kernel's table lookup of the low (high) 16 bits of word wd puts code e = j (4 + j) in
    /// a0 (a2) byte j. Every code meets its own x exactly once.
    #[test]
    fn nl_integer_fragments_pair_each_code_with_its_x_once() {
        let mut x_at = std::collections::HashMap::new();
        for lane in 0..32usize {
            for i in 0..4usize {
                let (tq, wd, reg) = (lane / 8, (lane / 2) % 4, lane % 2);
                assert!(x_at.insert((tq, wd, reg, i), 4 * lane + i).is_none());
            }
        }
        let mut seen = [0u8; GROUP];
        for tq in 0..4 {
            for wd in 0..4 {
                for j in 0..4 {
                    for (reg, e) in [(0usize, j), (1, 4 + j)] {
                        let code_k = 32 * tq + 8 * wd + e;
                        assert_eq!(x_at[&(tq, wd, reg, j)], code_k, "tq {tq} wd {wd} j {j}");
                        seen[code_k] += 1;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }

    /// Host mirror of xprep's exact three-byte split and of the kernel's recombination: for every
    /// X in range, X = 65536·x2 + 256·x1 + x0 with bytes in [-127, 127], and Σ (u − 8)·X equals
    /// 65536·(C2 − 8·S2) + (256·C1 + C0 − 8·S10) without overflowing i32 at the extremes.
    #[test]
    fn integer_split_is_exact_and_the_recombination_fits_i32() {
        const M: i32 = 0x7f7f7f;
        let split = |x: i32| {
            let x0 = (x & 0xff) as u8 as i8 as i32;
            let r = (x - x0) >> 8;
            let x1 = (r & 0xff) as u8 as i8 as i32;
            let x2 = (r - x1) >> 8;
            (x0, x1, x2)
        };
        for x in (-M..=M)
            .step_by(9973)
            .chain([-M, M, 0, -1, 1, 127, 128, -128, -129])
        {
            let (x0, x1, x2) = split(x);
            assert_eq!(65536 * x2 + 256 * x1 + x0, x, "{x}");
            for b in [x0, x1, x2] {
                assert!((-128..=127).contains(&b), "{x}: byte {b}");
            }
        }
        // Worst case for the brackets: every code 15 or 0 against every X = ±M.
        for (u, x) in [(15i64, M), (0, M), (15, -M), (0, -M)] {
            let (x0, x1, x2) = split(x);
            let (c2, c1, c0) = (
                128 * u * x2 as i64,
                128 * u * x1 as i64,
                128 * u * x0 as i64,
            );
            let (s2, s10) = (128 * x2 as i64, 128 * (256 * x1 + x0) as i64);
            let hi = c2 - 8 * s2;
            let lo = 256 * c1 + c0 - 8 * s10;
            for v in [c2, c1, c0, hi, lo, 8 * s2, 8 * s10, 256 * c1 + c0] {
                assert!(v.abs() < i32::MAX as i64, "u {u} x {x}: {v}");
            }
            assert_eq!(65536 * hi + lo, 128 * (u - 8) * x as i64);
        }
    }

    /// Mirrors the column-packed kernel (`gemv_q4i8c*`) on one 16-row tile and one 128-group for
    /// a token pair: `gemv_q4i8c_xprep`'s layout ([wd·12 + c·4 + tq] = part c < 3; token column
    /// 4h + c reads part c, column 4h + 3 part 0 again), the lanes' A and B fragments, the
    /// m16n8k32 product, and each lane's recombination v = C[2tq]·mul + C[2tq + 1]·mul1 + corr
    /// (even tq: (256, 1), corr −8·S10; odd: (1, 0), corr −8·S2, weight 65536). For every row and
    /// token the lane pair gives Σ (u − 8)·X exactly.
    #[test]
    fn column_packed_fragments_recombine_to_the_exact_group_sum() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        const M: i32 = 0x7f7f7f;
        let split = |x: i32| {
            let x0 = (x & 0xff) as u8 as i8 as i32;
            let r = (x - x0) >> 8;
            let x1 = (r & 0xff) as u8 as i8 as i32;
            (x0, x1, (r - x1) >> 8)
        };
        let mut rng = StdRng::seed_from_u64(7);
        for round in 0..20 {
            let u: Vec<[i64; GROUP]> = (0..16)
                .map(|_| std::array::from_fn(|_| rng.random_range(0..16)))
                .collect();
            // Two tokens; round 0 at the extremes.
            let xs: [[i32; GROUP]; 2] = std::array::from_fn(|h| {
                std::array::from_fn(|k| match round {
                    0 if (k + h) % 2 == 0 => M,
                    0 => -M,
                    _ => rng.random_range(-M..=M),
                })
            });
            // Column c of token h reads part c (0 = x1, 1 = x0, 2 = x2; column 3 part 0).
            let part = |h: usize, c: usize, k: usize| -> i64 {
                let (x0, x1, x2) = split(xs[h][k]);
                [x1, x0, x2, x1][c] as i64
            };
            let (s2, s10): (Vec<i64>, Vec<i64>) = (0..2)
                .map(|h| {
                    let (mut a, mut b) = (0i64, 0i64);
                    for &x in &xs[h] {
                        let (x0, x1, x2) = split(x);
                        a += x2 as i64;
                        b += (256 * x1 + x0) as i64;
                    }
                    (a, b)
                })
                .unzip();
            // C[row][col] summed over the four k32 steps wd. Step wd: A row r k-slot 4tq + j holds
            // nibble 2j of lane tq's word wd (code 32tq + 8wd + 2j), slot 16 + 4tq + j nibble
            // 2j + 1; B column col at the same slots holds (xprep) part col % 4 of token col / 4
            // at the same codes.
            let mut c = [[0i64; 8]; 16];
            for wd in 0..4 {
                for (cr, ur) in c.iter_mut().zip(&u) {
                    for (col, cc) in cr.iter_mut().enumerate() {
                        for slot in 0..32 {
                            let (tq, j, odd) = ((slot % 16) / 4, slot % 4, slot >= 16);
                            let k = 32 * tq + 8 * wd + 2 * j + usize::from(odd);
                            *cc += ur[k] * part(col / 4, col % 4, k);
                        }
                    }
                }
            }
            for r in 0..16 {
                for h in 0..2 {
                    // Lanes tq = 2h (even) and 2h + 1 (odd) of this token.
                    let lane_v = |tq: usize| {
                        let (mul, mul1, corr) = if tq % 2 == 0 {
                            (256, 1, -8 * s10[h])
                        } else {
                            (1, 0, -8 * s2[h])
                        };
                        c[r][2 * tq] * mul + c[r][2 * tq + 1] * mul1 + corr
                    };
                    let (even, odd) = (lane_v(2 * h), lane_v(2 * h + 1));
                    assert!(even.abs() < i32::MAX as i64 && odd.abs() < 1 << 24);
                    let want: i64 = (0..GROUP).map(|k| (u[r][k] - 8) * xs[h][k] as i64).sum();
                    assert_eq!(even + 65536 * odd, want, "round {round} row {r} token {h}");
                }
            }
        }
    }
}
