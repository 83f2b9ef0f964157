//! The phase arena: prefill and decode are different layouts of one parent allocation, and
//! admission checks every phase's layout before anything is loaded.
//!
//! Regions of a phase layout (all inside the arena's single parent buffer, 256-byte aligned):
//!
//! | region | prefill | decode / verify |
//! |---|---|---|
//! | `kv_pool` (offset 0, stable base) | the rest | the rest (larger) |
//! | `workspace` (compute activations) | `chunk × per-token bytes` | `width × per-token bytes` |
//! | `attn_scratch` (resumable accumulator) | `chunk × q_heads × (head_dim + 2) × 4` | `width × …` |
//!
//! | `vision` (only in [`Phase::Vision`]) | — | — |
//!
//! [`Phase::Vision`] is an *arena loan*: the KV pool and the text workspaces are released (the
//! device KV mirrors are suspended; the host history stays the truth and every resident page is
//! refilled from it on the next text step) and one `vision` region of the requested bytes is
//! leased for the vision tower's weights and workspace. Returning the loan is an ordinary
//! transition back to a text phase, after which the arena's use is exactly the text-only level.
//!
//! Recurrent (GDN) state, weights, the host history and outputs live outside the arena.
//! A transition follows drain → invalidate → release leases → commit → rebind; the first two are
//! the KV manager's job ([`crate::streaming_kv::StreamingKv::set_phase`]), the rest is
//! [`PhaseArena::transition`]. A failed commit leaves the old layout (and its leases) in force.

use crate::error::{Result, RuntimeError};
use kvstream_memory_contracts::arena::{Arena, Lease};
use kvstream_memory_contracts::backend::{Backend, DeviceBuffer};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Alignment of every arena region.
pub const REGION_ALIGN: usize = 256;

/// What the arena is laid out for. Explicit; never inferred from a batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// Prompt processing in chunks: large workspace, smaller KV pool.
    Prefill,
    /// Token generation, `width` queries per step: small workspace, larger pool.
    Decode { width: usize },
    /// Speculative verification of `width` tokens (issue 5 fills this in).
    Verify { width: usize },
    /// Zero grants: the host history is kept, the device holds nothing.
    Suspended,
    /// Arena loan to the vision tower: no KV pool, no text workspace, one `vision` region of
    /// `bytes` (weights + workspace of one image encode). See [`crate::multimodal`].
    Vision { bytes: usize },
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Prefill => f.write_str("prefill"),
            Phase::Decode { width } => write!(f, "decode(width {width})"),
            Phase::Verify { width } => write!(f, "verify(width {width})"),
            Phase::Suspended => f.write_str("suspended"),
            Phase::Vision { bytes } => write!(f, "vision({bytes} bytes)"),
        }
    }
}

/// The model dimensions that size a phase's workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub q_heads: usize,
    pub head_dim: usize,
    /// Widest per-token projection of a recurrent (GDN) layer.
    pub recurrent_width: usize,
}

impl WorkspaceDims {
    /// f32 activation bytes one token needs in the compute workspace (an upper estimate of the
    /// live tensors of one layer plus the logits row).
    pub fn bytes_per_token(&self) -> usize {
        4 * (8 * self.hidden
            + 3 * self.intermediate
            + 3 * self.q_heads * self.head_dim
            + 2 * self.recurrent_width
            + self.vocab)
    }
}

/// Everything admission needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaPlanInput {
    /// Parent allocation size.
    pub arena_bytes: usize,
    /// KV page geometry.
    pub geometry: PageGeometry,
    /// Attention layers in the pool.
    pub layers: usize,
    /// Prefill chunk (tokens per prefill step).
    pub prefill_chunk: usize,
    /// Model dimensions.
    pub dims: WorkspaceDims,
    /// Minimum pool pages (one resident page per layer + the minimum ring).
    pub min_pool_pages: usize,
    /// Cap on the pool pages (the rest of the arena stays unused); None = no cap.
    pub max_pool_pages: Option<usize>,
}

/// The exact byte layout of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseLayout {
    pub phase: Phase,
    /// Bytes of the KV pool region (a whole number of pages).
    pub pool_bytes: usize,
    /// Pages of the KV pool.
    pub pool_pages: usize,
    /// Compute workspace bytes.
    pub workspace_bytes: usize,
    /// Attention scratch bytes.
    pub scratch_bytes: usize,
    /// Smallest arena that admits this phase.
    pub required_bytes: usize,
}

fn align(x: usize) -> usize {
    x.next_multiple_of(REGION_ALIGN)
}

/// Computes the layout of `phase`; fails with [`RuntimeError::ArenaTooSmall`] naming the phase,
/// the required bytes and the missing bytes.
pub fn plan_phase(input: &ArenaPlanInput, phase: Phase) -> Result<PhaseLayout> {
    let width = match phase {
        Phase::Prefill => input.prefill_chunk,
        Phase::Decode { width } | Phase::Verify { width } => width,
        Phase::Suspended | Phase::Vision { .. } => 0,
    };
    if let Phase::Vision { bytes } = phase {
        let region = align(bytes);
        if input.arena_bytes < region {
            return Err(RuntimeError::ArenaTooSmall {
                phase: phase.to_string(),
                required: region as u64,
                arena: input.arena_bytes as u64,
                missing: (region - input.arena_bytes) as u64,
            });
        }
        return Ok(PhaseLayout {
            phase,
            pool_bytes: 0,
            pool_pages: 0,
            workspace_bytes: region,
            scratch_bytes: 0,
            required_bytes: region,
        });
    }
    if phase == Phase::Suspended {
        return Ok(PhaseLayout {
            phase,
            pool_bytes: 0,
            pool_pages: 0,
            workspace_bytes: 0,
            scratch_bytes: 0,
            required_bytes: 0,
        });
    }
    let workspace_bytes = align(width * input.dims.bytes_per_token());
    let scratch_bytes =
        align(width * input.dims.q_heads * (input.dims.head_dim + 2) * std::mem::size_of::<f32>());
    let pb = input.geometry.page_bytes();
    let fixed = workspace_bytes + scratch_bytes;
    let required_bytes = fixed + align(input.min_pool_pages * pb);
    if input.arena_bytes < required_bytes {
        return Err(RuntimeError::ArenaTooSmall {
            phase: phase.to_string(),
            required: required_bytes as u64,
            arena: input.arena_bytes as u64,
            missing: (required_bytes - input.arena_bytes) as u64,
        });
    }
    let pool_pages = ((input.arena_bytes - fixed) / pb).min(
        input
            .max_pool_pages
            .unwrap_or(usize::MAX)
            .max(input.min_pool_pages),
    );
    Ok(PhaseLayout {
        phase,
        pool_bytes: pool_pages * pb,
        pool_pages,
        workspace_bytes,
        scratch_bytes,
        required_bytes,
    })
}

/// Admission: the layout of every phase in `phases`, or the first phase that does not fit.
pub fn admit(input: &ArenaPlanInput, phases: &[Phase]) -> Result<Vec<PhaseLayout>> {
    phases.iter().map(|&p| plan_phase(input, p)).collect()
}

/// Peak bytes of each region over the arena's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionPeaks {
    pub kv_pool: usize,
    pub workspace: usize,
    pub attn_scratch: usize,
    /// Largest vision loan ([`Phase::Vision`]).
    #[serde(default)]
    pub vision: usize,
    pub total: usize,
}

/// The parent allocation with its committed region map and the leases of the phase in force.
#[derive(Debug)]
pub struct PhaseArena<B: Backend> {
    parent: B::Buffer,
    arena: Arena,
    input: ArenaPlanInput,
    current: Option<PhaseLayout>,
    leases: Vec<Lease>,
    peaks: RegionPeaks,
}

impl<B: Backend> PhaseArena<B> {
    /// Wraps a parent allocation of `input.arena_bytes` bytes (no layout committed yet).
    pub fn new(parent: B::Buffer, input: ArenaPlanInput) -> Result<Self> {
        if parent.len() < input.arena_bytes {
            return Err(RuntimeError::InvalidConfig(format!(
                "arena parent has {} bytes, {} requested",
                parent.len(),
                input.arena_bytes
            )));
        }
        Ok(Self {
            parent,
            arena: Arena::new(input.arena_bytes),
            input,
            current: None,
            leases: Vec::new(),
            peaks: RegionPeaks::default(),
        })
    }

    /// The parent buffer (every pool offset is relative to it).
    pub fn parent(&self) -> &B::Buffer {
        &self.parent
    }
    /// The layout in force.
    pub fn layout(&self) -> Option<&PhaseLayout> {
        self.current.as_ref()
    }
    /// Phase in force.
    pub fn phase(&self) -> Option<Phase> {
        self.current.map(|c| c.phase)
    }
    /// Byte range `(offset, len)` of the KV pool in the parent.
    pub fn pool_range(&self) -> Result<(usize, usize)> {
        let v = self.arena.view("kv_pool")?;
        Ok((v.offset, v.len))
    }
    /// Byte range `(offset, len)` of the `vision` region of a [`Phase::Vision`] loan.
    pub fn vision_range(&self) -> Result<(usize, usize)> {
        let v = self.arena.view("vision")?;
        Ok((v.offset, v.len))
    }
    /// The admission input.
    pub fn input(&self) -> &ArenaPlanInput {
        &self.input
    }
    /// Peak use by region.
    pub fn peaks(&self) -> RegionPeaks {
        self.peaks
    }
    /// The arena metadata.
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Release leases → commit the layout of `phase` → rebind (lease the new regions).
    ///
    /// The caller must have drained and invalidated everything that points into the pool. On
    /// failure the old layout stays committed and its leases are re-acquired.
    pub fn transition(&mut self, phase: Phase) -> Result<PhaseLayout> {
        let _span = tracing::info_span!("phase_transition", %phase).entered();
        let layout = plan_phase(&self.input, phase)?;
        let old_leases = std::mem::take(&mut self.leases);
        drop(old_leases);
        let staged = (|| {
            let mut s = self.arena.begin(false);
            if layout.pool_bytes > 0 {
                s.reserve_at("kv_pool", 0, layout.pool_bytes, false)?;
            }
            // A vision loan's region is named `vision` so that nothing text-side can lease it.
            let ws_id = if matches!(phase, Phase::Vision { .. }) {
                "vision"
            } else {
                "workspace"
            };
            if layout.workspace_bytes > 0 {
                s.reserve(ws_id, layout.workspace_bytes, REGION_ALIGN, false)?;
            }
            if layout.scratch_bytes > 0 {
                s.reserve("attn_scratch", layout.scratch_bytes, REGION_ALIGN, false)?;
            }
            Ok::<_, RuntimeError>(s)
        })();
        let committed = staged.and_then(|s| self.arena.commit(s).map_err(RuntimeError::from));
        if let Err(e) = committed {
            self.rebind();
            return Err(e);
        }
        self.current = Some(layout);
        self.rebind();
        self.peaks.kv_pool = self.peaks.kv_pool.max(layout.pool_bytes);
        if matches!(phase, Phase::Vision { .. }) {
            self.peaks.vision = self.peaks.vision.max(layout.workspace_bytes);
        } else {
            self.peaks.workspace = self.peaks.workspace.max(layout.workspace_bytes);
        }
        self.peaks.attn_scratch = self.peaks.attn_scratch.max(layout.scratch_bytes);
        self.peaks.total = self.peaks.total.max(self.arena.used());
        Ok(layout)
    }

    fn rebind(&mut self) {
        self.leases = ["kv_pool", "workspace", "attn_scratch", "vision"]
            .iter()
            .filter_map(|id| self.arena.lease(id).ok())
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::kv::format::KvType;

    fn input(arena: usize) -> ArenaPlanInput {
        ArenaPlanInput {
            arena_bytes: arena,
            geometry: PageGeometry::new(16, 1, 64, KvType::F16, KvType::F16).expect("valid"),
            layers: 2,
            prefill_chunk: 64,
            dims: WorkspaceDims {
                hidden: 128,
                intermediate: 256,
                vocab: 512,
                q_heads: 6,
                head_dim: 64,
                recurrent_width: 512,
            },
            min_pool_pages: 3,
            max_pool_pages: None,
        }
    }

    #[test]
    fn prefill_has_larger_workspace_and_smaller_pool() {
        let inp = input(4 << 20);
        let ls = admit(&inp, &[Phase::Prefill, Phase::Decode { width: 1 }]).expect("fits");
        assert!(ls[0].workspace_bytes > ls[1].workspace_bytes);
        assert!(ls[0].pool_pages < ls[1].pool_pages);
        for l in &ls {
            assert!(l.pool_bytes + l.workspace_bytes + l.scratch_bytes <= inp.arena_bytes);
        }
    }

    #[test]
    fn too_small_arena_names_phase_required_and_missing() {
        let big = plan_phase(&input(64 << 20), Phase::Prefill).expect("fits");
        let inp = input(big.required_bytes - 100);
        match admit(&inp, &[Phase::Prefill, Phase::Decode { width: 1 }]) {
            Err(RuntimeError::ArenaTooSmall {
                phase,
                required,
                missing,
                ..
            }) => {
                assert_eq!(phase, "prefill");
                assert_eq!(required as usize, big.required_bytes);
                assert_eq!(missing, 100);
            }
            other => panic!("expected ArenaTooSmall, got {other:?}"),
        }
        // Exactly the required size is admitted.
        assert!(plan_phase(&input(big.required_bytes), Phase::Prefill).is_ok());
    }

    #[test]
    fn transitions_keep_the_pool_base_and_failures_keep_the_old_layout() {
        use kvstream_backend_cpu::CpuBackend;
        use kvstream_memory_contracts::transfer::DeviceMemory;
        let b = CpuBackend::new();
        let inp = input(4 << 20);
        let parent = b.alloc_buffer(inp.arena_bytes).expect("alloc");
        let mut a: PhaseArena<CpuBackend> = PhaseArena::new(parent, inp).expect("arena");
        let pre = a.transition(Phase::Prefill).expect("prefill fits");
        let (off0, len0) = a.pool_range().expect("pool");
        let dec = a
            .transition(Phase::Decode { width: 1 })
            .expect("decode fits");
        let (off1, len1) = a.pool_range().expect("pool");
        assert_eq!(off0, off1, "the pool keeps its base address");
        assert!(len1 > len0 && dec.pool_pages > pre.pool_pages);
        assert_eq!(a.arena().lease_count("kv_pool"), 1, "rebound");

        // A foreign lease on the pool makes the next commit fail: the old layout stays in force.
        let foreign = a.arena().lease("kv_pool").expect("lease");
        let err = a
            .transition(Phase::Prefill)
            .expect_err("leased pool cannot shrink");
        assert!(matches!(err, RuntimeError::Arena(_)), "{err:?}");
        assert_eq!(a.phase(), Some(Phase::Decode { width: 1 }));
        assert_eq!(a.pool_range().expect("pool"), (off1, len1));
        assert_eq!(
            a.arena().lease_count("kv_pool"),
            2,
            "our lease was re-acquired"
        );
        drop(foreign);
        a.transition(Phase::Prefill)
            .expect("works once the foreign lease is gone");
        assert_eq!(a.peaks().kv_pool, len1);

        // A vision loan releases the pool and leases one `vision` region; returning it restores
        // the text layout and the arena's use exactly.
        let text_used = a.arena().used();
        let loan = a
            .transition(Phase::Vision { bytes: 1000 })
            .expect("loan fits");
        assert_eq!((loan.pool_pages, loan.workspace_bytes), (0, 1024));
        assert!(a.pool_range().is_err(), "no KV pool during a loan");
        assert_eq!(a.arena().used(), 1024);
        assert_eq!(a.arena().lease_count("vision"), 1);
        assert_eq!(a.peaks().vision, 1024);
        let too_big = a
            .transition(Phase::Vision {
                bytes: inp.arena_bytes + 1,
            })
            .expect_err("larger than the arena");
        assert!(matches!(too_big, RuntimeError::ArenaTooSmall { .. }));
        assert_eq!(a.phase(), Some(Phase::Vision { bytes: 1000 }));
        a.transition(Phase::Prefill).expect("back to text");
        assert_eq!(a.arena().used(), text_used);
        assert_eq!(a.pool_range().expect("pool"), (off0, len0));

        // A phase that does not fit is refused before anything changes.
        let mut tight = input(pre.required_bytes);
        tight.prefill_chunk = 10_000;
        let parent = b.alloc_buffer(tight.arena_bytes).expect("alloc");
        let mut t: PhaseArena<CpuBackend> = PhaseArena::new(parent, tight).expect("arena");
        assert!(matches!(
            t.transition(Phase::Prefill),
            Err(RuntimeError::ArenaTooSmall { .. })
        ));
        assert_eq!(t.phase(), None);
    }
}
