//! Streamed attention on the device: fixed interleaved token splits (64-token chunks dealt round
//! robin), one kernel launch per span, one final combine (see `kernels/src/cu/attention.cu`).
//!
//! Two accumulate kernels share one state layout (`[n_splits, width, q_heads, head_dim + 2]`, max
//! in the log2 domain) and one finish kernel:
//!
//! * `attn_q8q4_n{1..4}_d{64,128,256}` — the tensor-core path for Q8_0 K / Q4_0 V (exact operands): decode
//!   and verification (widths 1..=4, one tile of every query) and prefill chunks (tiles of
//!   `32 / group` queries over grid z, each tile skipping the chunks its causal mask hides),
//!   chosen when [`CudaBackend::attention_uses_fast_path`] says so;
//! * `attn_accumulate` — every other K/V pair or page size (SIMT).
//!
//! The kernel of an evaluation is a function of its shape and page geometry only (both fixed for
//! the whole evaluation), so every span and wave of one evaluation runs the same arithmetic.

use crate::launch::args;
use crate::ops::kv_code;
use crate::tensor_map::{unused_map, PlaneMap, TensorMap};
use crate::{CudaBackend, CudaBuffer, CudaTensor};
use cudarc::driver::{sys, CudaFunction, DeviceRepr, LaunchConfig};
use kvstream_kernels::launch::{
    ATT_FAST_CHUNK, ATT_FAST_ROWS, ATT_FAST_SROW, ATT_FAST_THREADS, ATT_FINISH_DIMS,
    ATT_FINISH_THREADS, ATT_MAX_SPLITS, ATT_QW, ATT_THREADS, ATT_TILE,
};
use kvstream_memory_contracts::attention::{AttentionShape, StreamedAttention};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::{AttentionError, CapabilityError, OpError};
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::SpanPlan;
use std::sync::OnceLock;

/// Most splits of one evaluation (the finish kernel keeps one weight per split).
pub const MAX_SPLITS: usize = ATT_MAX_SPLITS;

/// Blocks an evaluation aims for (KV heads × query blocks × splits): about four per SM of an H200.
const TARGET_BLOCKS: usize = 512;

/// Fewest tokens per split worth a block of its own.
const MIN_SPLIT_TOKENS: usize = 256;

/// Environment switch forcing the generic kernel (A/B measurements; any value but `0`).
pub const FORCE_GENERIC_ENV: &str = "KVSTREAM_ATTN_GENERIC";

/// The fixed, interleaved token splits of one evaluation: the tokens form chunks of [`ATT_TILE`]
/// (64) tokens, chunk `c` = `[64c, min(64c + 64, total))`, and split `s` owns the chunks with
/// `c % count == s`. A function of the shape only (never of the span layout); `count` never exceeds
/// the number of chunks, so every split owns at least one chunk (its first is chunk `s`), and any
/// span of `64 * count` consecutive tokens holds a chunk of every split: a streamed ring wave keeps
/// as many blocks busy as a resident walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnSplits {
    /// Number of splits (`1..=MAX_SPLITS`, at most the number of chunks).
    pub count: usize,
}

/// Host mirror of the kernels' ownership arithmetic, checked by the unit tests below (the kernels
/// compute the same thing per block; the launcher itself only passes `count`).
#[cfg(test)]
impl AttnSplits {
    /// The split owning chunk `chunk` (tokens `[64 * chunk, 64 * chunk + 64)`).
    pub fn owner(&self, chunk: usize) -> usize {
        chunk % self.count
    }

    /// The chunks of split `split` holding tokens of `[first, end)`, in token order: exactly what
    /// one kernel launch over a span `[first, end)` walks for that split (mirrors the index
    /// arithmetic of both accumulate kernels). Empty when the split has no token there.
    pub fn chunks_in(&self, split: usize, first: usize, end: usize) -> impl Iterator<Item = usize> {
        let n = self.count.max(1);
        if end <= first || split >= n {
            return (0..0).step_by(n);
        }
        let (lo, hi) = (first / ATT_TILE, end.div_ceil(ATT_TILE));
        let start = lo + (split + n - lo % n) % n;
        (start..hi).step_by(n)
    }

    /// Whether a launch over `[first, end)` starts split `split` fresh: it processes the split's
    /// first token, `64 * split` (mirrors `fresh` in both accumulate kernels).
    pub fn starts_fresh(&self, split: usize, first: usize, end: usize) -> bool {
        self.chunks_in(split, first, end)
            .next()
            .is_some_and(|c| (c * ATT_TILE).max(first) == split * ATT_TILE)
    }
}

/// The splits of an evaluation: enough (KV head, split) blocks to fill the GPU in a resident walk
/// (`TARGET_BLOCKS`), at most [`MAX_SPLITS`], and at most one per `MIN_SPLIT_TOKENS` (256) tokens
/// (so at most one per 4 chunks: every split owns ≥ 1 chunk).
///
/// State traffic: every launch reads and writes the state rows of the splits it touches,
/// `count × width × q_heads × (head_dim + 2) × 4` bytes each way. For the 27B decode (24 query
/// heads × 256, width 1, 64 splits) that is 1.6 MB each way per launch — resident in the 50 MB L2
/// across the waves of one layer — against 8.1 MB of K/V HBM reads for a 4,864-token wave
/// (4 KV heads × 416 B per token); a resident walk pays it once.
#[cfg(test)]
pub fn attn_splits(shape: &AttentionShape) -> AttnSplits {
    attn_splits_for(shape, TARGET_BLOCKS)
}

/// [`attn_splits`] aiming for `target_blocks` blocks instead of the default 512: the backend
/// passes what one wave of the fast kernel holds on its device ([`CudaBackend`]'s split target),
/// so a resident walk never leaves a short second wave.
pub fn attn_splits_for(shape: &AttentionShape, target_blocks: usize) -> AttnSplits {
    let total = shape.total.max(1);
    let q_blocks = shape.width.div_ceil(ATT_QW).max(1);
    let per_head = target_blocks.max(1) / (shape.kv_heads.max(1) * q_blocks);
    let count = per_head
        .clamp(1, MAX_SPLITS)
        .min(total.div_ceil(MIN_SPLIT_TOKENS))
        // The invariant the kernels and attn_finish rely on: every split owns chunk `s`.
        .min(total.div_ceil(ATT_TILE))
        .max(1);
    AttnSplits { count }
}

/// Launch choice of the fast kernel for one evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FastCfg {
    /// n-tiles of 8 query rows (`ceil(group * qt / 8)`).
    nt: usize,
    /// Queries per block (grid z = `ceil(width / qt)`): the whole width for decode and
    /// verification (width ≤ 4), `32 / group` for prefill.
    qt: usize,
    /// Dynamic shared memory in bytes.
    smem: usize,
}

/// Shared memory of the fast kernel (mirrors the layout comment in attention.cu).
fn fast_smem_bytes(head_dim: usize, nt: usize) -> usize {
    let khb = head_dim / 32 * 34;
    let vhb = head_dim / 32 * 18;
    // K double buffered (FA_KBUF1, one n-tile: single), V single buffered, query fragments, scores
    // of the 8·nt rows, m/l/alpha.
    let k_buffers = if nt == 1 && single_k_buffer() { 1 } else { 2 };
    k_buffers * ATT_FAST_CHUNK * khb
        + ATT_FAST_CHUNK * vhb
        + head_dim / 16 * nt * 32 * 16
        + 8 * nt * ATT_FAST_SROW * 4
        + 3 * ATT_FAST_ROWS * 4
        // Three mbarriers (FA_TMA: the K buffers and the V buffer), padded to 32 bytes.
        + 32
        // FA_PIPE: the second score buffer.
        + if pipelined_softmax() { 8 * nt * ATT_FAST_SROW * 4 } else { 0 }
}

/// Whether the fast kernel is built with `FA_PIPE=1` (an A/B define, off by default: warp 0's
/// softmax of a chunk overlaps the QK of the next on the tensor-map path, scores double buffered).
fn pipelined_softmax() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::compile::define_on("FA_PIPE", false))
}

/// Whether the fast kernel is built with `FA_KBUF1=1` (an A/B define, off by default: the
/// one-n-tile instances keep one K buffer and fit five blocks per SM).
fn single_k_buffer() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::compile::define_on("FA_KBUF1", false))
}

/// The fast kernel's configuration if it applies to `shape` over pages of geometry `g` with
/// `max_smem` bytes of opt-in shared memory. A function of shape and geometry only.
fn fast_cfg(shape: &AttentionShape, g: &PageGeometry, max_smem: usize) -> Option<FastCfg> {
    if shape.k_type != KvType::Q8_0 || shape.v_type != KvType::Q4_0 {
        return None;
    }
    if !matches!(shape.head_dim, 64 | 128 | 256) {
        return None;
    }
    if shape.width == 0 || shape.kv_heads == 0 {
        return None;
    }
    let group = shape.q_heads / shape.kv_heads;
    if group == 0 || group > ATT_FAST_ROWS || g.tokens_per_page() < ATT_FAST_CHUNK {
        return None;
    }
    // Decode/verification: one tile of every query (the row order of widths 1..=4 is the one
    // the bit-identity across widths relies on). Prefill: tiles of as many queries as fit.
    let qt = if shape.width <= ATT_QW && group * shape.width <= ATT_FAST_ROWS {
        shape.width
    } else {
        (ATT_FAST_ROWS / group).min(shape.width)
    };
    let nt = (group * qt).div_ceil(8);
    let smem = fast_smem_bytes(shape.head_dim, nt);
    (smem <= max_smem).then_some(FastCfg { nt, qt, smem })
}

/// Environment override of the split target (blocks per evaluation; A/B measurements).
pub const TARGET_BLOCKS_ENV: &str = "KVSTREAM_ATTN_TARGET_BLOCKS";

fn target_override() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| {
        std::env::var(TARGET_BLOCKS_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v: &usize| v > 0)
    })
}

/// The fast kernel's instances (attention.cu: one entry point each, with its own register
/// budget), by head_dim (64, 128, 256) and query n-tiles (1..=4).
const FAST_KERNELS: [(usize, [&str; 4]); 3] = [
    (
        64,
        [
            "attn_q8q4_n1_d64",
            "attn_q8q4_n2_d64",
            "attn_q8q4_n3_d64",
            "attn_q8q4_n4_d64",
        ],
    ),
    (
        128,
        [
            "attn_q8q4_n1_d128",
            "attn_q8q4_n2_d128",
            "attn_q8q4_n3_d128",
            "attn_q8q4_n4_d128",
        ],
    ),
    (
        256,
        [
            "attn_q8q4_n1_d256",
            "attn_q8q4_n2_d256",
            "attn_q8q4_n3_d256",
            "attn_q8q4_n4_d256",
        ],
    ),
];

/// The fast kernel's instance for `nt` query n-tiles (1..=4) and `head_dim` (64, 128, 256).
fn fast_kernel_name(nt: usize, head_dim: usize) -> Option<&'static str> {
    let (_, names) = FAST_KERNELS.iter().find(|(d, _)| *d == head_dim)?;
    names.get(nt.checked_sub(1)?).copied()
}

/// Fast-kernel launches so far that passed tensor maps (FA_TMA), process-wide: lets the GPU tests
/// prove the tensor-copy path ran rather than fell back to cp.async.
static TMA_LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Whether the fast kernel is built with `FA_TMA` (tensor-map chunk copies; the default, turned off
/// by `FA_TMA=0` in [`crate::compile::NVRTC_DEFINES_ENV`]): its launches then pass one K and one V
/// tensor map per span.
fn tma_copies() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::compile::define_on("FA_TMA", true))
}

fn force_generic() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var(FORCE_GENERIC_ENV).is_ok_and(|v| v != "0"))
}

/// Widest copy (16, 4 or 1 bytes) for which every K/V head row address of the fast kernel is
/// aligned: pool base + span offset, page, row, plane and head strides.
fn copy_width(base: u64, g: &PageGeometry) -> i32 {
    let parts = [
        base,
        g.page_bytes() as u64,
        g.k_row_bytes() as u64,
        g.v_row_bytes() as u64,
        g.v_plane_offset() as u64,
        g.k_head_bytes() as u64,
        g.v_head_bytes() as u64,
    ];
    if parts.iter().all(|p| p % 16 == 0) {
        16
    } else if parts.iter().all(|p| p % 4 == 0) {
        4
    } else {
        1
    }
}

/// The K and V tensor maps of a span of `tokens` tokens at device address `base` (FA_TMA), or
/// `None` (with the reason at debug level) where the TMA unit cannot copy its boxes: the launch then
/// takes the cp.async path.
fn span_maps(g: &PageGeometry, base: u64, tokens: usize) -> Option<(TensorMap, TensorMap)> {
    let encode = |v: bool| {
        PlaneMap::of_span(g, base, tokens, v, ATT_FAST_CHUNK as u32)
            .encode()
            .map_err(|why| tracing::debug!(why, v, "attention tensor map refused"))
            .ok()
    };
    Some((encode(false)?, encode(true)?))
}

/// Mirrors `struct AttnGeo` in attention.cu (repr(C), same field order and types).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnGeo {
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    width: i32,
    total: i32,
    scale_log2: f32,
    k_type: i32,
    v_type: i32,
    tpp: i32,
    page_bytes: u64,
    k_row_bytes: u64,
    v_row_bytes: u64,
    k_head_bytes: u64,
    v_head_bytes: u64,
    v_plane_off: u64,
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for AttnGeo {}

fn op_err(e: OpError) -> AttentionError {
    match e {
        OpError::Capability(c) => AttentionError::Capability(c),
        OpError::Attention(a) => a,
        OpError::Transfer(t) => AttentionError::Transfer(t),
        other => AttentionError::Transfer(
            kvstream_memory_contracts::error::TransferError::CopyFailed(other.to_string()),
        ),
    }
}

fn cap(detail: String) -> AttentionError {
    AttentionError::Capability(CapabilityError::new("cuda", "streamed_attention", detail))
}

/// Shared-memory bytes of one generic block for `rows` query rows and a unit of `unit` tokens.
fn smem_bytes(rows: usize, unit: usize, d: usize) -> usize {
    4 * (2 * rows * d + unit * (d + 1) + unit * d + rows * unit + 3 * rows)
}

fn check_state(
    shape: &AttentionShape,
    splits: &AttnSplits,
    state: &CudaTensor,
) -> Result<(), AttentionError> {
    if state.numel() != splits.count * shape.state_len() {
        return Err(AttentionError::Shape {
            name: "state",
            got: state.numel(),
            expected: splits.count * shape.state_len(),
        });
    }
    Ok(())
}

fn reserve_smem(f: &CudaFunction, smem: usize) -> Result<(), AttentionError> {
    crate::launch::allow_dynamic_smem(f, smem).map_err(|r| {
        cap(format!(
            "cannot reserve {smem} bytes of shared memory: {r:?}"
        ))
    })?;
    // The whole unified L1/shared array as shared memory where the driver can use it (a hint:
    // without it the driver may pick a smaller carveout than 3 blocks of ~70 KB need). K and V
    // travel by cp.async.cg, which bypasses L1 anyway.
    // SAFETY: as above; the carveout is a percentage in 0..=100.
    let hint = unsafe {
        sys::cuFuncSetAttribute(
            f.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        )
    };
    if hint != sys::CUresult::CUDA_SUCCESS {
        tracing::debug!(?hint, "shared-memory carveout hint refused");
    }
    Ok(())
}

impl CudaBackend {
    /// The splits of every evaluation of `shape` on this device. For K/V types and head sizes the
    /// fast kernel serves, the target is one full wave of it: SMs × the blocks of its width-1
    /// layout that fit on one SM (shared memory, registers); the same for widths 1..=4, so a
    /// verification row is computed exactly as the single-query step would. Otherwise (and when
    /// the occupancy query fails) [`TARGET_BLOCKS`]. `KVSTREAM_ATTN_TARGET_BLOCKS` overrides.
    pub fn attn_splits(&self, shape: &AttentionShape) -> AttnSplits {
        let target = target_override().unwrap_or_else(|| self.fast_wave_blocks(shape));
        attn_splits_for(shape, target)
    }

    fn fast_wave_blocks(&self, shape: &AttentionShape) -> usize {
        let fast_types = shape.k_type == KvType::Q8_0 && shape.v_type == KvType::Q4_0;
        if !fast_types || !matches!(shape.head_dim, 64 | 128 | 256) || force_generic() {
            return TARGET_BLOCKS;
        }
        self.fast_kernel(shape.head_dim).1
    }

    /// The tensor-core attention instance an evaluation of `shape` over pages of geometry `g`
    /// runs (`attn_q8q4_n{nt}_d{head_dim}`), or `None` when it takes the generic kernel.
    pub fn fast_attention_kernel(
        &self,
        shape: &AttentionShape,
        g: &PageGeometry,
    ) -> Option<&'static str> {
        if force_generic() {
            return None;
        }
        let cfg = fast_cfg(shape, g, self.max_smem_optin)?;
        fast_kernel_name(cfg.nt, shape.head_dim)
    }

    /// The width-1 instance of the fast kernel for `head_dim` and one full wave of it in blocks
    /// (cached): SMs × its blocks per SM (shared memory, registers). A function of head_dim
    /// alone, so every width of a shape (decode, verification) runs with the same splits.
    fn fast_kernel(&self, head_dim: usize) -> (&'static str, usize) {
        let mut cache = self
            .attn_wave_blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(&v) = cache.get(&head_dim) {
            return v;
        }
        let name = fast_kernel_name(1, head_dim).unwrap_or("attn_q8q4_n1_d256");
        let smem = fast_smem_bytes(head_dim, 1);
        let per_sm = || -> Option<usize> {
            let f = self.func(name).ok()?;
            if smem > self.max_smem_optin {
                return None;
            }
            reserve_smem(f, smem).ok()?;
            let n = f
                .occupancy_max_active_blocks_per_multiprocessor(ATT_FAST_THREADS as u32, smem, None)
                .ok()?;
            (n > 0).then_some(n as usize)
        };
        let blocks = per_sm().map_or(TARGET_BLOCKS, |b| b * self.sm_count).max(1);
        tracing::debug!(head_dim, kernel = name, blocks, "attention split target");
        cache.insert(head_dim, (name, blocks));
        (name, blocks)
    }

    /// The generic kernel's token unit: the largest of 32, 16, 8, 4, 2, 1 dividing the page size
    /// whose shared memory fits; `None` if nothing fits.
    fn attn_unit(&self, shape: &AttentionShape, tpp: usize) -> Option<(usize, usize)> {
        let g = shape.q_heads / shape.kv_heads;
        let rows = g * ATT_QW.min(shape.width);
        [32usize, 16, 8, 4, 2, 1]
            .into_iter()
            .filter(|u| tpp % u == 0)
            .map(|u| (u, smem_bytes(rows, u, shape.head_dim)))
            .find(|&(_, b)| b <= self.max_smem_optin)
    }

    /// Fast-kernel launches in this process that copied K/V chunks with tensor maps (FA_TMA, the
    /// default unless `KVSTREAM_NVRTC_DEFINES` sets `FA_TMA=0`; an sm_90+ device, 16-byte aligned
    /// 256-dim heads).
    pub fn attention_tensor_map_launches(&self) -> usize {
        TMA_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when an evaluation of `shape` over pages of `geometry` runs the tensor-core decode
    /// kernel (Q8_0 K / Q4_0 V, head_dim 64/128/256, group ≤ 32 query heads per KV head, pages of
    /// ≥ 64 tokens, shared memory fits, and `KVSTREAM_ATTN_GENERIC` unset). Fixed per evaluation.
    pub fn attention_uses_fast_path(
        &self,
        shape: &AttentionShape,
        geometry: &PageGeometry,
    ) -> bool {
        self.fast_attention_kernel(shape, geometry).is_some()
    }

    fn attn_geo(shape: &AttentionShape, g: &PageGeometry) -> AttnGeo {
        AttnGeo {
            q_heads: shape.q_heads as i32,
            kv_heads: shape.kv_heads as i32,
            head_dim: shape.head_dim as i32,
            width: shape.width as i32,
            total: shape.total as i32,
            scale_log2: shape.scale * std::f32::consts::LOG2_E,
            k_type: kv_code(g.k_type()),
            v_type: kv_code(g.v_type()),
            tpp: g.tokens_per_page() as i32,
            page_bytes: g.page_bytes() as u64,
            k_row_bytes: g.k_row_bytes() as u64,
            v_row_bytes: g.v_row_bytes() as u64,
            k_head_bytes: g.k_head_bytes() as u64,
            v_head_bytes: g.v_head_bytes() as u64,
            v_plane_off: g.v_plane_offset() as u64,
        }
    }

    fn attn_accumulate_fast(
        &self,
        shape: &AttentionShape,
        cfg: FastCfg,
        splits: AttnSplits,
        q: &CudaTensor,
        pool: &CudaBuffer,
        plan: &SpanPlan,
        state: &mut CudaTensor,
    ) -> Result<(), AttentionError> {
        let g = plan.geometry();
        let name = fast_kernel_name(cfg.nt, shape.head_dim)
            .ok_or_else(|| cap(format!("no fast attention instance for {cfg:?}")))?;
        let f = self.func(name).map_err(op_err)?;
        reserve_smem(f, cfg.smem)?;
        let geo = Self::attn_geo(shape, g);
        let launch = LaunchConfig {
            grid_dim: (
                shape.kv_heads as u32,
                splits.count as u32,
                shape.width.div_ceil(cfg.qt) as u32,
            ),
            block_dim: (ATT_FAST_THREADS as u32, 1, 1),
            shared_mem_bytes: cfg.smem as u32,
        };
        let (qp, pp, sp) = (q.ptr(), pool.ptr(), state.ptr());
        let (ns, qt) = (splits.count as i32, cfg.qt as i32);
        let tma = tma_copies() && self.arch_at_least(90);
        for span in plan.spans() {
            let vec = copy_width(pp + span.offset as u64, g);
            let (off, first, count) = (
                span.offset as u64,
                span.first_token as i32,
                span.count as i32,
            );
            let maps = if tma && vec == 16 {
                span_maps(g, pp + off, span.count)
            } else {
                None
            };
            let (tk, tv, tm) = maps.map_or((unused_map(), unused_map(), 0i32), |(k, v)| (k, v, 1));
            if tm != 0 {
                TMA_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let mut a =
                args![&qp, &pp, &sp, &geo, &off, &first, &count, &ns, &vec, &qt, &tk, &tv, &tm];
            self.launch(name, f, launch, &mut a).map_err(op_err)?;
        }
        Ok(())
    }
}

impl StreamedAttention for CudaBackend {
    fn attn_state_new(&self, shape: &AttentionShape) -> Result<CudaTensor, AttentionError> {
        // Left uninitialised: the launch holding a split's first token starts that split fresh,
        // and every split holds a token, so attn_finish only reads written state.
        let s = self.attn_splits(shape);
        self.tensor_uninit(&[s.count, shape.width, shape.q_heads, shape.head_dim + 2])
            .map_err(op_err)
    }

    fn attn_accumulate_unchecked(
        &self,
        shape: &AttentionShape,
        q: &CudaTensor,
        pool: &CudaBuffer,
        plan: &SpanPlan,
        state: &mut CudaTensor,
    ) -> Result<(), AttentionError> {
        let _span = tracing::trace_span!(
            "attn_accumulate",
            start = plan.start(),
            end = plan.end(),
            spans = plan.spans().len()
        )
        .entered();
        let g = plan.geometry();
        let splits = self.attn_splits(shape);
        check_state(shape, &splits, state)?;
        if shape.total > i32::MAX as usize / 2 {
            return Err(cap(format!(
                "{} tokens exceed the kernel's i32 range",
                shape.total
            )));
        }
        if !force_generic() {
            if let Some(cfg) = fast_cfg(shape, g, self.max_smem_optin) {
                return self.attn_accumulate_fast(shape, cfg, splits, q, pool, plan, state);
            }
        }
        let (unit, smem) = self.attn_unit(shape, g.tokens_per_page()).ok_or_else(|| {
            cap(format!(
                "{} query heads per KV head × head_dim {} need more shared memory than the device's {} bytes",
                shape.q_heads / shape.kv_heads,
                shape.head_dim,
                self.max_smem_optin
            ))
        })?;
        let f = self.func("attn_accumulate").map_err(op_err)?;
        reserve_smem(f, smem)?;
        let geo = Self::attn_geo(shape, g);
        let cfg = LaunchConfig {
            grid_dim: (
                shape.kv_heads as u32,
                splits.count as u32,
                shape.width.div_ceil(ATT_QW) as u32,
            ),
            block_dim: (ATT_THREADS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (qp, pp, sp) = (q.ptr(), pool.ptr(), state.ptr());
        let (ns, u) = (splits.count as i32, unit as i32);
        for span in plan.spans() {
            let (off, first, count) = (
                span.offset as u64,
                span.first_token as i32,
                span.count as i32,
            );
            let mut a = args![&qp, &pp, &sp, &geo, &off, &first, &count, &ns, &u];
            self.launch("attn_accumulate", f, cfg, &mut a)
                .map_err(op_err)?;
        }
        Ok(())
    }

    fn attn_finish_unchecked(
        &self,
        shape: &AttentionShape,
        state: &CudaTensor,
    ) -> Result<CudaTensor, AttentionError> {
        let splits = self.attn_splits(shape);
        check_state(shape, &splits, state)?;
        let out = self
            .tensor_uninit(&[shape.width, shape.q_heads * shape.head_dim])
            .map_err(op_err)?;
        let f = self.func("attn_finish").map_err(op_err)?;
        let (sp, op, ns, w, h, d) = (
            state.ptr(),
            out.ptr(),
            splits.count as i32,
            shape.width as i32,
            shape.q_heads as i32,
            shape.head_dim as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (
                (shape.width * shape.q_heads) as u32,
                shape.head_dim.div_ceil(ATT_FINISH_DIMS) as u32,
                1,
            ),
            block_dim: (ATT_FINISH_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = args![&sp, &op, &ns, &w, &h, &d];
        self.launch("attn_finish", f, cfg, &mut a).map_err(op_err)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(width: usize, total: usize, kv_heads: usize) -> AttentionShape {
        AttentionShape {
            q_heads: 6 * kv_heads,
            kv_heads,
            head_dim: 256,
            width,
            total,
            scale: 0.0625,
            k_type: KvType::Q8_0,
            v_type: KvType::Q4_0,
        }
    }

    #[test]
    fn every_fast_instance_is_a_listed_kernel() {
        for d in [64, 128, 256] {
            for nt in 1..=4 {
                let name = fast_kernel_name(nt, d).expect("instance");
                assert!(kvstream_kernels::module_of(name).is_some(), "{name}");
                assert!(name.contains(&format!("_n{nt}_d{d}")), "{name}");
            }
            assert_eq!(fast_kernel_name(5, d), None);
            assert_eq!(fast_kernel_name(0, d), None);
        }
        assert_eq!(fast_kernel_name(1, 96), None);
    }

    #[test]
    fn every_split_owns_a_chunk_and_the_resident_walk_fills_the_gpu() {
        for total in [
            1usize, 63, 64, 65, 300, 2047, 5000, 65_536, 262_144, 1_000_003,
        ] {
            for width in [1usize, 4, 7, 64, 512] {
                if width > total {
                    continue;
                }
                let s = attn_splits(&shape(width, total, 4));
                assert!(
                    s.count >= 1 && s.count <= MAX_SPLITS,
                    "{total}/{width}: {s:?}"
                );
                // Split s's first chunk is chunk s: it must exist (attn_finish reads every split).
                assert!(
                    s.count <= total.div_ceil(ATT_TILE),
                    "{total}/{width}: empty split {s:?}"
                );
                // The resident walk touches every split, each starting fresh exactly there.
                for split in 0..s.count {
                    assert!(s.starts_fresh(split, 0, total), "{total}: split {split}");
                }
            }
        }
        let s = attn_splits(&shape(1, 65_536, 4));
        assert!(s.count * 4 >= 132, "too few blocks at 64 Ki: {s:?}");
    }

    /// Chunk c's tokens inside `[first, end)` as launched for split `split` (empty if none).
    fn walk(s: &AttnSplits, split: usize, first: usize, end: usize) -> Vec<(usize, usize)> {
        s.chunks_in(split, first, end)
            .map(|c| {
                (
                    (c * ATT_TILE).max(first),
                    (c * ATT_TILE + ATT_TILE).min(end),
                )
            })
            .collect()
    }

    #[test]
    fn interleaving_keeps_every_split_busy_in_every_256ki_wave() {
        let total = 262_144;
        // Half of a 32 MiB ring of 27B pages (64 slots of 256 tokens); the engine's default
        // streaming ring (128 MiB floor) makes waves about 2.5× longer still. Every split has a
        // chunk in every wave while a wave holds at least `count` chunks (128 here, 99 with the
        // H200's one-wave target).
        let wave = 64 * 256;
        let s = attn_splits(&shape(1, total, 4));
        assert!(s.count * 4 >= 132, "too few blocks: {s:?}");
        let chunks = total / ATT_TILE;
        let mut seen = vec![0usize; chunks];
        let mut w0 = 0;
        let mut waves = 0;
        while w0 < total {
            let w1 = (w0 + wave).min(total);
            for split in 0..s.count {
                let cs: Vec<usize> = s.chunks_in(split, w0, w1).collect();
                assert!(!cs.is_empty(), "split {split} idle in wave [{w0}, {w1})");
                for c in cs {
                    assert_eq!(s.owner(c), split);
                    assert!(c * ATT_TILE >= w0 && c * ATT_TILE < w1, "chunk {c} outside");
                    seen[c] += 1;
                }
                assert_eq!(s.starts_fresh(split, w0, w1), w0 == 0, "split {split}");
            }
            w0 = w1;
            waves += 1;
        }
        assert!(waves >= 16);
        assert!(
            seen.iter().all(|&n| n == 1),
            "chunk coverage: {:?}",
            seen.iter().enumerate().find(|(_, &n)| n != 1)
        );
    }

    #[test]
    fn streamed_chunk_walk_equals_the_resident_walk_for_any_page_aligned_spans() {
        // Deterministic xorshift: random page-aligned span layouts over small and large pages.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as usize
        };
        for _ in 0..200 {
            let tpp = [16usize, 32, 64, 128, 256][next(5)];
            let total = 1 + next(20_000);
            let width = 1 + next(8);
            let s = attn_splits(&shape(width.min(total), total, 1 + next(4)));
            // Spans of 1..=12 pages in token order.
            let mut spans = Vec::new();
            let mut t = 0;
            while t < total {
                let end = (t + (1 + next(12)) * tpp).min(total);
                spans.push((t, end));
                t = end;
            }
            for split in 0..s.count {
                let resident = walk(&s, split, 0, total);
                assert!(!resident.is_empty());
                let mut streamed = Vec::new();
                let mut fresh_seen = false;
                for &(a, b) in &spans {
                    let part = walk(&s, split, a, b);
                    if part.is_empty() {
                        assert!(!s.starts_fresh(split, a, b));
                        continue;
                    }
                    // The first launch touching a split starts it fresh; no other does.
                    assert_eq!(
                        s.starts_fresh(split, a, b),
                        !fresh_seen,
                        "split {split} at {a}"
                    );
                    fresh_seen = true;
                    streamed.extend(part);
                }
                // Merge pieces of chunks cut by span boundaries (pages < 64 tokens).
                let mut merged: Vec<(usize, usize)> = Vec::new();
                for (a, b) in streamed {
                    match merged.last_mut() {
                        Some(last) if last.1 == a && a % ATT_TILE != 0 => last.1 = b,
                        _ => merged.push((a, b)),
                    }
                }
                assert_eq!(merged, resident, "tpp {tpp} total {total} split {split}");
            }
        }
    }

    #[test]
    fn fast_path_covers_27b_decode_and_prefill_tiles() {
        let g = PageGeometry::new(256, 4, 256, KvType::Q8_0, KvType::Q4_0).expect("geometry");
        let limit = 227 * 1024;
        for width in 1..=4 {
            let c = fast_cfg(&shape(width, 65_536, 4), &g, limit).expect("fast");
            assert_eq!(c.nt, (6 * width).div_ceil(8));
            assert_eq!(c.qt, width, "decode/verify: one tile of every query");
            assert!(c.smem <= limit / 2, "two blocks per SM: {}", c.smem);
        }
        // Prefill chunks: tiles of 32 / 6 = 5 queries (30 rows), the last one partial.
        for width in [5, 9, 256] {
            let c = fast_cfg(&shape(width, 65_536, 4), &g, limit).expect("fast prefill");
            assert_eq!((c.qt, c.nt), (5, 4), "width {width}");
        }
        let small = PageGeometry::new(16, 4, 256, KvType::Q8_0, KvType::Q4_0).expect("geometry");
        assert!(fast_cfg(&shape(1, 4096, 4), &small, limit).is_none());
        let mut bf = shape(1, 4096, 4);
        bf.k_type = KvType::Bf16;
        assert!(fast_cfg(&bf, &g, limit).is_none());
    }

    #[test]
    fn copy_width_follows_alignment() {
        let g = PageGeometry::new(256, 4, 256, KvType::Q8_0, KvType::Q4_0).expect("geometry");
        assert_eq!(copy_width(0, &g), 16);
        assert_eq!(copy_width(4, &g), 4);
        assert_eq!(copy_width(2, &g), 1);
        let g64 = PageGeometry::new(64, 2, 64, KvType::Q8_0, KvType::Q4_0).expect("geometry");
        assert_eq!(copy_width(0, &g64), 4);
    }
}
