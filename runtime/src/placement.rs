//! The device pool's byte layout for one [`Placement`], and span plans over it.
//!
//! Inside the pool region of the arena (starting at `pool_offset` of the arena's parent buffer)
//! the ring comes first (slot `i` at `ring_base + i·page_bytes`), then each layer's resident
//! pages, contiguous (page `p` of layer `l` at `layer_base[l] + p·page_bytes`). Pages have the
//! host's geometry (K plane, then aligned V plane), so a run of contiguous host pages and a run
//! of contiguous ring slots or resident pages are each one byte range: one copy moves them.

use crate::error::{Result, RuntimeError};
use crate::policy::Placement;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};

/// Byte layout of the pool for one placement. Constructed only if it fits the pool region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayout {
    geometry: PageGeometry,
    placement: Placement,
    buffer_len: usize,
    ring_base: usize,
    layer_base: Vec<usize>,
}

/// A run of ring slots holding consecutive pages of one layer (never wraps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingRun {
    /// First logical page of the layer held by the run.
    pub first_page: usize,
    /// Pages in the run.
    pub pages: usize,
    /// First ring slot.
    pub first_slot: usize,
}

impl PoolLayout {
    /// Lays out `placement` in `[pool_offset, pool_offset + pool_len)` of a parent buffer of
    /// `buffer_len` bytes. Fails if the placement needs more bytes than the region has.
    pub fn new(
        geometry: PageGeometry,
        placement: Placement,
        buffer_len: usize,
        pool_offset: usize,
        pool_len: usize,
    ) -> Result<Self> {
        let pb = geometry.page_bytes();
        let need = placement
            .total_pages()
            .checked_mul(pb)
            .ok_or_else(|| RuntimeError::Placement("pool size overflows".into()))?;
        if need > pool_len
            || pool_offset
                .checked_add(pool_len)
                .is_none_or(|e| e > buffer_len)
        {
            return Err(RuntimeError::Placement(format!(
                "placement of {} pages × {pb} bytes does not fit the pool region of {pool_len} bytes",
                placement.total_pages()
            )));
        }
        if pool_offset % geometry.plane_align() != 0 {
            return Err(RuntimeError::Placement(format!(
                "pool offset {pool_offset} is not aligned to {}",
                geometry.plane_align()
            )));
        }
        let ring_base = pool_offset;
        let mut cursor = ring_base + placement.ring_slots * pb;
        let mut layer_base = Vec::with_capacity(placement.resident.len());
        for &r in &placement.resident {
            layer_base.push(cursor);
            cursor += r * pb;
        }
        Ok(Self {
            geometry,
            placement,
            buffer_len,
            ring_base,
            layer_base,
        })
    }

    /// The page geometry.
    pub fn geometry(&self) -> &PageGeometry {
        &self.geometry
    }
    /// The placement laid out.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
    /// Ring slots.
    pub fn ring_slots(&self) -> usize {
        self.placement.ring_slots
    }
    /// Resident pages of `layer`.
    pub fn resident(&self, layer: usize) -> usize {
        self.placement.resident.get(layer).copied().unwrap_or(0)
    }
    /// Byte offset (in the parent buffer) of ring slot `slot`.
    pub fn slot_offset(&self, slot: usize) -> usize {
        self.ring_base + slot * self.geometry.page_bytes()
    }
    /// Byte offset of resident page `page` of `layer`.
    pub fn resident_offset(&self, layer: usize, page: usize) -> usize {
        self.layer_base
            .get(layer)
            .copied()
            .unwrap_or(self.ring_base)
            + page * self.geometry.page_bytes()
    }

    /// The span plan of `layer` covering tokens `[start, end)`: the resident part of that range
    /// (if any), then `runs` of ring slots in token order. `start` is a page boundary;
    /// `runs` must cover exactly the streamed pages of the range.
    pub fn plan(
        &self,
        layer: usize,
        start: usize,
        end: usize,
        runs: &[RingRun],
    ) -> Result<SpanPlan> {
        let tpp = self.geometry.tokens_per_page();
        let res_end = (self.resident(layer) * tpp).min(end);
        let mut spans = Vec::with_capacity(1 + runs.len());
        let mut cursor = start;
        if start < res_end {
            spans.push(Span {
                source: SpanSource::Resident {
                    layer,
                    first_page: start / tpp,
                },
                first_token: start,
                count: res_end - start,
                offset: self.resident_offset(layer, start / tpp),
            });
            cursor = res_end;
        }
        for run in runs {
            let first = run.first_page * tpp;
            let last = ((run.first_page + run.pages) * tpp).min(end);
            if last <= first {
                continue;
            }
            spans.push(Span {
                source: SpanSource::Ring {
                    first_slot: run.first_slot,
                },
                first_token: first,
                count: last - first,
                offset: self.slot_offset(run.first_slot),
            });
            cursor = cursor.max(last);
        }
        let _ = cursor;
        Ok(SpanPlan::new(
            self.geometry,
            self.buffer_len,
            start,
            end,
            spans,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::kv::format::KvType;

    fn geo() -> PageGeometry {
        PageGeometry::new(16, 2, 32, KvType::Q8_0, KvType::F16).expect("valid")
    }

    #[test]
    fn layout_packs_ring_then_layers_and_rejects_overflow() {
        let g = geo();
        let pb = g.page_bytes();
        let p = Placement {
            resident: vec![2, 3],
            ring_slots: 4,
        };
        let l = PoolLayout::new(g, p.clone(), 100 * pb, 10 * pb, 9 * pb).expect("fits");
        assert_eq!(l.slot_offset(0), 10 * pb);
        assert_eq!(l.resident_offset(0, 0), 14 * pb);
        assert_eq!(l.resident_offset(1, 2), 18 * pb);
        assert!(PoolLayout::new(g, p, 100 * pb, 0, 8 * pb).is_err());
    }

    #[test]
    fn plan_walks_resident_then_ring_runs() {
        let g = geo();
        let pb = g.page_bytes();
        let p = Placement {
            resident: vec![2],
            ring_slots: 3,
        };
        let l = PoolLayout::new(g, p, 5 * pb, 0, 5 * pb).expect("fits");
        // 70 tokens = 5 pages: 2 resident, pages 2..5 through slots 2, 0, 1 (wrapped: two runs).
        let runs = [
            RingRun {
                first_page: 2,
                pages: 1,
                first_slot: 2,
            },
            RingRun {
                first_page: 3,
                pages: 2,
                first_slot: 0,
            },
        ];
        let plan = l.plan(0, 0, 70, &runs).expect("valid");
        assert_eq!(plan.spans().len(), 3);
        assert_eq!(
            plan.locate(5).map(|x| x.0),
            Some(3 * pb + 5 * g.k_row_bytes())
        );
        assert_eq!(plan.locate(33).map(|x| x.0), Some(2 * pb + g.k_row_bytes()));
        assert_eq!(plan.locate(69).map(|x| x.0), Some(pb + 5 * g.k_row_bytes()));
        // A second wave starting at page 3 has no resident part.
        let w2 = l.plan(0, 48, 70, &runs[1..]).expect("valid");
        assert_eq!(w2.spans().len(), 1);
        // A gap is rejected by the span plan.
        assert!(l.plan(0, 0, 70, &runs[1..]).is_err());
    }
}
