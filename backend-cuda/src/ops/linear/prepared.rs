//! Fused x prep: the producers of a q4 decode GEMV's input write its integer fragments too.
//!
//! The column-packed integer GEMVs (`gemv_q4i8c*`, `gemv_q4nli8c*`) read x rounded per 128-group
//! to 22-bit integers in three bytes ([`super::q4mma::I8C_XPREP_BYTES_PER_GROUP`] per token and
//! group), made by an x-prep launch before every GEMV: 256 launches per 27B decode step. The ops
//! whose output a decode GEMV reads (the RMSNorms, the gated RMSNorm, SwiGLU and the sigmoid gate)
//! instead write those bytes beside their f32 output, from the values in registers
//! (`q4c_prep_group` in common.cuh, the same routine as the x-prep kernels, so the bytes are the
//! same), and attach them to the output tensor as a [`PreparedX`]. The GEMV takes them when the
//! layout matches and runs no x prep; anything else (another path, a view, a copy, a width above
//! [`GEMV_MAX_T`]) prepares x as before. Results are bit-identical either way.
//!
//! Which outputs get one: an output of `numel` values when the q4 path is the column-packed
//! integer kernel and `numel = t·K` for a K of a loaded 4-bit weight ([`FusedPrep::register`],
//! from `load_weight`) with `t ≤ GEMV_MAX_T` and `K % 128 == 0`. The cost where nothing reads it
//! (a q-norm whose output only feeds RoPE) is 400 bytes written per 128 values.

use super::q4mma::{Q4Gemv, I8C_XPREP_BYTES_PER_GROUP};
use super::q4mmap::MmapKind;
use crate::{CudaBackend, CudaTensor, DeviceAlloc};
use kvstream_kernels::launch::GEMV_MAX_T;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Environment switch: `1` turns the fused x prep on, `0` off (every q4 GEMV runs its x-prep
/// launch; the A/B for benchmarks). Unset: [`FUSED_PREP_DEFAULT`].
pub const FUSED_PREP_ENV: &str = "KVSTREAM_Q4_FUSED_PREP";

/// Whether the fused x prep is on when [`FUSED_PREP_ENV`] is unset: on since session 15 (GPU
/// suite `backend-cuda/tests/fused_prep.rs` and the engine check passed with it on; 27B q4_g128
/// decode −3.5% at 8 Ki and 32 Ki on an H100, docs/benchmarks.md "session 15").
pub const FUSED_PREP_DEFAULT: bool = true;

/// Values per x-prep group.
const GROUP: usize = 128;

/// The layout of a [`PreparedX`] (the `prep` code the producer kernels take).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrepLayout {
    /// `gemv_q4i8c*` (q4_g128): `PREP_I8C`.
    I8Cols,
    /// `gemv_q4nli8c*` (q4_nl_g128): `PREP_I8C_NL`.
    I8ColsNl,
}

impl PrepLayout {
    /// The kernels' `prep` argument (common.cuh `PREP_I8C` / `PREP_I8C_NL`).
    pub(crate) fn code(self) -> i32 {
        match self {
            PrepLayout::I8Cols => 1,
            PrepLayout::I8ColsNl => 2,
        }
    }

    /// The layout a GEMV kind reads, if it is one a producer writes.
    pub(crate) fn of_kind(kind: MmapKind) -> Option<Self> {
        match kind {
            MmapKind::Int8Cols => Some(PrepLayout::I8Cols),
            MmapKind::Int8ColsNl => Some(PrepLayout::I8ColsNl),
            _ => None,
        }
    }
}

/// x-prep bytes a producer wrote for its whole output (every 128-value group in element order,
/// so any reshape of the same values keeps them valid).
#[derive(Debug, Clone)]
pub(crate) struct PreparedX {
    pub(crate) alloc: Arc<DeviceAlloc>,
    pub(crate) layout: PrepLayout,
    /// 128-value groups covered (the output's `numel / 128`).
    pub(crate) groups: usize,
}

/// The K values (with their layout) producers prepare for, and the on/off switch.
#[derive(Debug)]
pub(crate) struct FusedPrep {
    enabled: AtomicBool,
    /// In registration order; an output matching several takes the first (a model whose 4-bit
    /// weights mix both formats prepares for the first format loaded; the other GEMVs prepare x
    /// themselves).
    targets: Mutex<Vec<(usize, PrepLayout)>>,
    /// x-prep launches the q4 GEMVs ran (tests and benchmarks check the fused path is taken).
    xprep_launches: AtomicU64,
}

impl FusedPrep {
    pub(crate) fn from_env() -> Self {
        Self {
            enabled: AtomicBool::new(
                std::env::var(FUSED_PREP_ENV).map_or(FUSED_PREP_DEFAULT, |v| v.trim() != "0"),
            ),
            targets: Mutex::new(Vec::new()),
            xprep_launches: AtomicU64::new(0),
        }
    }

    /// Notes a loaded weight: a 4-bit `[N, K]` weight with `K % 128 == 0` makes K a target, in
    /// the layout of its format.
    pub(crate) fn register(&self, dtype: WeightDType, dims: &[usize]) {
        let layout = match dtype {
            WeightDType::Q4G128 => PrepLayout::I8Cols,
            WeightDType::Q4NlG128 => PrepLayout::I8ColsNl,
            _ => return,
        };
        let [_, k] = dims else { return };
        if *k == 0 || k % GROUP != 0 {
            return;
        }
        if let Ok(mut t) = self.targets.lock() {
            if !t.contains(&(*k, layout)) {
                t.push((*k, layout));
            }
        }
    }

    /// The layout a producer output of `numel` values should carry under `path`, if any.
    fn layout_for(&self, path: Q4Gemv, numel: usize) -> Option<PrepLayout> {
        if !self.enabled.load(Ordering::Relaxed) || path.resolved() != Q4Gemv::Int8Cols {
            return None;
        }
        let t = self.targets.lock().ok()?;
        t.iter()
            .find(|(k, _)| numel > 0 && numel % k == 0 && numel / k <= GEMV_MAX_T)
            .map(|&(_, layout)| layout)
    }
}

impl CudaBackend {
    /// Turns the fused x prep on or off (overrides [`FUSED_PREP_ENV`]; results are identical).
    pub fn set_fused_prep(&self, on: bool) {
        self.fused_prep.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether producers write x-prep bytes now.
    pub fn fused_prep(&self) -> bool {
        self.fused_prep.enabled.load(Ordering::Relaxed)
    }

    /// x-prep launches the q4 GEMVs have run on this backend (each GEMV whose input carried no
    /// usable [`PreparedX`] runs one).
    pub fn q4_xprep_launches(&self) -> u64 {
        self.fused_prep.xprep_launches.load(Ordering::Relaxed)
    }

    /// Counts one x-prep launch.
    pub(crate) fn note_xprep_launch(&self) {
        self.fused_prep
            .xprep_launches
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Allocates the x-prep bytes for a producer output `out` (16-byte aligned, as every tensor
    /// is) when one should carry them ([`prep_args`] gives the kernel's arguments), `None` for
    /// none. The caller stores the result in the output's `prepared` after its launch.
    pub(crate) fn prepare_output(&self, out: &CudaTensor) -> Result<Option<PreparedX>, OpError> {
        let numel = out.dims.iter().product::<usize>();
        let Some(layout) = self.fused_prep.layout_for(self.q4_gemv(), numel) else {
            return Ok(None);
        };
        if out.ptr() % 16 != 0 {
            return Ok(None);
        }
        let groups = numel / GROUP;
        let alloc = self.alloc_bytes(groups * I8C_XPREP_BYTES_PER_GROUP, "prepared x")?;
        Ok(Some(PreparedX {
            alloc,
            layout,
            groups,
        }))
    }

    /// The x-prep bytes of `x` a `kind` GEMV of `t × k` can read instead of preparing x.
    pub(crate) fn prepared_for(
        x: &CudaTensor,
        kind: MmapKind,
        t: usize,
        k: usize,
    ) -> Option<&PreparedX> {
        let p = x.prepared.as_ref()?;
        (Some(p.layout) == PrepLayout::of_kind(kind) && p.groups * GROUP == t * k).then_some(p)
    }
}

/// The kernel arguments for an optional [`PreparedX`]: `(xf pointer, prep code)`.
pub(crate) fn prep_args(p: Option<&PreparedX>) -> (u64, i32) {
    p.map_or((0, 0), |p| (p.alloc.ptr(), p.layout.code()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prep() -> FusedPrep {
        FusedPrep {
            enabled: AtomicBool::new(true),
            targets: Mutex::new(Vec::new()),
            xprep_launches: AtomicU64::new(0),
        }
    }

    #[test]
    fn only_4bit_weights_with_whole_groups_become_targets() {
        let p = prep();
        p.register(WeightDType::Bf16, &[5120, 6144]);
        p.register(WeightDType::Q8_0, &[5120, 6144]);
        p.register(WeightDType::Q4G128, &[5120, 100]);
        p.register(WeightDType::Q4G128, &[7]);
        assert_eq!(p.layout_for(Q4Gemv::Auto, 6144), None);
        p.register(WeightDType::Q4G128, &[34816, 5120]);
        p.register(WeightDType::Q4G128, &[34816, 5120]);
        assert_eq!(p.targets.lock().map(|t| t.len()).ok(), Some(1));
        assert_eq!(p.layout_for(Q4Gemv::Auto, 5120), Some(PrepLayout::I8Cols));
        p.register(WeightDType::Q4NlG128, &[5120, 17408]);
        assert_eq!(
            p.layout_for(Q4Gemv::Auto, 3 * 17408),
            Some(PrepLayout::I8ColsNl)
        );
    }

    #[test]
    fn outputs_wider_than_a_gemv_or_off_path_get_none() {
        let p = prep();
        p.register(WeightDType::Q4G128, &[6144, 5120]);
        assert_eq!(
            p.layout_for(Q4Gemv::Auto, 8 * 5120),
            Some(PrepLayout::I8Cols)
        );
        assert_eq!(p.layout_for(Q4Gemv::Auto, 9 * 5120), None);
        assert_eq!(p.layout_for(Q4Gemv::Auto, 5120 + 128), None);
        assert_eq!(p.layout_for(Q4Gemv::Auto, 0), None);
        assert_eq!(
            p.layout_for(Q4Gemv::Int8Cols, 5120),
            Some(PrepLayout::I8Cols)
        );
        for other in [Q4Gemv::Int8, Q4Gemv::MmaPersistent, Q4Gemv::Simt] {
            assert_eq!(p.layout_for(other, 5120), None, "{other:?}");
        }
        p.enabled.store(false, Ordering::Relaxed);
        assert_eq!(p.layout_for(Q4Gemv::Auto, 5120), None);
    }

    #[test]
    fn layouts_match_the_kernels_that_read_them() {
        assert_eq!(
            PrepLayout::of_kind(MmapKind::Int8Cols),
            Some(PrepLayout::I8Cols)
        );
        assert_eq!(
            PrepLayout::of_kind(MmapKind::Int8ColsNl),
            Some(PrepLayout::I8ColsNl)
        );
        for k in [
            MmapKind::Int8,
            MmapKind::Int8Nl,
            MmapKind::SplitBf16,
            MmapKind::SplitBf16Nl,
        ] {
            assert_eq!(PrepLayout::of_kind(k), None);
        }
        assert_eq!(PrepLayout::I8Cols.code(), 1);
        assert_eq!(PrepLayout::I8ColsNl.code(), 2);
        assert_eq!(prep_args(None), (0, 0));
    }
}
