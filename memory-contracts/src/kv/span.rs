//! Span plans: which physical pages hold which logical tokens of one layer.
//!
//! A [`SpanPlan`] is an ordered list of spans that covers exactly `[start, end)` of one layer's
//! tokens in logical order. Each span names its physical source (resident pages of a layer, or
//! ring slots), its first token, its token count and the byte offset of its first page inside the
//! pool buffer. A run of pages in one span is contiguous in memory (page stride =
//! [`PageGeometry::page_bytes`]). A plan is validated once, at construction: an invalid plan
//! cannot exist as a value.

use crate::error::SpanError;
use crate::kv::geometry::PageGeometry;

/// Where a span's pages physically live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpanSource {
    /// Resident pages of `layer`, starting at its resident page `first_page`.
    Resident { layer: usize, first_page: usize },
    /// Ring slots starting at `first_slot` (contiguous, never wrapping inside one span).
    Ring { first_slot: usize },
}

/// One contiguous run of pages holding tokens `[first_token, first_token + count)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    pub source: SpanSource,
    pub first_token: usize,
    pub count: usize,
    /// Byte offset of the span's first page inside the pool buffer.
    pub offset: usize,
}

impl Span {
    /// One past the last token.
    pub fn end_token(&self) -> usize {
        self.first_token + self.count
    }
}

/// A validated, ordered cover of `[start, end)` by spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanPlan {
    geometry: PageGeometry,
    buffer_len: usize,
    start: usize,
    end: usize,
    spans: Vec<Span>,
}

impl SpanPlan {
    /// Validates `spans` as a cover of `[start, end)` inside a buffer of `buffer_len` bytes.
    pub fn new(
        geometry: PageGeometry,
        buffer_len: usize,
        start: usize,
        end: usize,
        spans: Vec<Span>,
    ) -> Result<Self, SpanError> {
        let tpp = geometry.tokens_per_page();
        if start > end || start % tpp != 0 {
            return Err(SpanError::Range { start, end });
        }
        if spans.is_empty() && start < end {
            return Err(SpanError::Empty { start, end });
        }
        let mut expected = start;
        let mut previous_first: Option<usize> = None;
        for (index, s) in spans.iter().enumerate() {
            if s.count == 0 {
                return Err(SpanError::ZeroLength { index });
            }
            if let Some(prev) = previous_first {
                if s.first_token < prev {
                    return Err(SpanError::Reordered {
                        index,
                        previous: prev,
                        first: s.first_token,
                    });
                }
            }
            if s.first_token < expected {
                return Err(SpanError::Overlap {
                    index,
                    expected,
                    first: s.first_token,
                });
            }
            if s.first_token > expected {
                return Err(SpanError::Gap {
                    index,
                    expected,
                    first: s.first_token,
                });
            }
            if s.first_token % tpp != 0 {
                return Err(SpanError::PageMisaligned {
                    index,
                    first: s.first_token,
                    tokens_per_page: tpp,
                });
            }
            if s.offset % geometry.plane_align() != 0 {
                return Err(SpanError::ByteMisaligned {
                    index,
                    offset: s.offset,
                    align: geometry.plane_align(),
                });
            }
            let pages = geometry.pages_for(s.count);
            let bytes = pages.checked_mul(geometry.page_bytes());
            let span_end = bytes.and_then(|b| b.checked_add(s.offset));
            match span_end {
                Some(e) if e <= buffer_len => {}
                _ => {
                    return Err(SpanError::OutOfBuffer {
                        index,
                        offset: s.offset,
                        end: span_end.unwrap_or(usize::MAX),
                        buffer_len,
                    })
                }
            }
            expected = s.first_token.saturating_add(s.count);
            previous_first = Some(s.first_token);
        }
        if expected != end {
            return Err(SpanError::Coverage {
                start,
                covered: expected,
                end,
            });
        }
        Ok(Self {
            geometry,
            buffer_len,
            start,
            end,
            spans,
        })
    }

    pub fn geometry(&self) -> &PageGeometry {
        &self.geometry
    }
    /// Length of the buffer the plan was validated against.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }
    /// First token covered.
    pub fn start(&self) -> usize {
        self.start
    }
    /// One past the last token covered.
    pub fn end(&self) -> usize {
        self.end
    }
    /// The spans in token order.
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }
    /// Byte offsets of token `t`'s K and V rows, or `None` if `t` is outside the plan.
    pub fn locate(&self, t: usize) -> Option<(usize, usize)> {
        let i = self.spans.partition_point(|s| s.end_token() <= t);
        let s = self.spans.get(i)?;
        if t < s.first_token {
            return None;
        }
        Some((
            self.geometry.k_row_offset(s.offset, s.first_token, t),
            self.geometry.v_row_offset(s.offset, s.first_token, t),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::format::KvType;
    use proptest::prelude::*;

    fn geo() -> PageGeometry {
        PageGeometry::new(16, 2, 32, KvType::Q8_0, KvType::Q4_0).expect("valid")
    }

    fn span(first: usize, count: usize, offset: usize) -> Span {
        Span {
            source: SpanSource::Ring { first_slot: 0 },
            first_token: first,
            count,
            offset,
        }
    }

    #[test]
    fn each_failure_has_its_own_variant() {
        let g = geo();
        let pb = g.page_bytes();
        let buf = pb * 8;
        let ok = SpanPlan::new(g, buf, 0, 40, vec![span(0, 32, 0), span(32, 8, 4 * pb)]);
        assert!(ok.is_ok());
        let e = |spans, end| SpanPlan::new(g, buf, 0, end, spans).err();
        assert!(matches!(e(vec![], 16), Some(SpanError::Empty { .. })));
        assert!(matches!(
            e(vec![span(0, 0, 0)], 16),
            Some(SpanError::ZeroLength { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 16, 0), span(32, 16, pb)], 48),
            Some(SpanError::Gap { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 32, 0), span(16, 16, 2 * pb)], 48),
            Some(SpanError::Overlap { .. })
        ));
        assert!(matches!(
            e(vec![span(16, 16, 0), span(0, 16, pb)], 32),
            Some(SpanError::Gap { .. }) | Some(SpanError::Reordered { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 16, 0), span(16, 16, pb)], 40),
            Some(SpanError::Coverage { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 16, 8)], 16),
            Some(SpanError::ByteMisaligned { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 16, 8 * pb)], 16),
            Some(SpanError::OutOfBuffer { .. })
        ));
        assert!(matches!(
            e(vec![span(0, 10, 0), span(10, 6, pb)], 16),
            Some(SpanError::PageMisaligned { .. })
        ));
        assert!(matches!(
            SpanPlan::new(g, buf, 3, 16, vec![span(3, 13, 0)]),
            Err(SpanError::Range { .. })
        ));
        // A reordering with the later span starting before an earlier one's start.
        assert!(matches!(
            e(
                vec![span(0, 16, 0), span(16, 16, pb), span(0, 16, 2 * pb)],
                48
            ),
            Some(SpanError::Reordered { .. })
        ));
    }

    #[test]
    fn locate_matches_geometry() {
        let g = geo();
        let pb = g.page_bytes();
        let plan = SpanPlan::new(g, pb * 8, 0, 40, vec![span(0, 32, 2 * pb), span(32, 8, 0)])
            .expect("valid");
        assert_eq!(plan.locate(0), Some((2 * pb, 2 * pb + g.v_plane_offset())));
        assert_eq!(plan.locate(17).map(|x| x.0), Some(3 * pb + g.k_row_bytes()));
        assert_eq!(plan.locate(33).map(|x| x.0), Some(g.k_row_bytes()));
        assert_eq!(plan.locate(40), None);
    }

    proptest! {
        /// Random page-aligned cuts of [0, n) into spans always validate; perturbing one span's
        /// start always fails.
        #[test]
        fn random_plans(n_pages in 1usize..40, tail in 0usize..16, cuts in proptest::collection::vec(any::<bool>(), 40), shift in 1usize..20) {
            let g = geo();
            let tpp = g.tokens_per_page();
            let end = (n_pages - 1) * tpp + tail.max(1);
            let pages = g.pages_for(end);
            let buf = pages * g.page_bytes();
            let mut spans = Vec::new();
            let mut first_page = 0;
            for p in 1..=pages {
                if p == pages || cuts[p % cuts.len()] {
                    let first = first_page * tpp;
                    let count = (p * tpp).min(end) - first;
                    spans.push(span(first, count, first_page * g.page_bytes()));
                    first_page = p;
                }
            }
            prop_assert!(SpanPlan::new(g, buf, 0, end, spans.clone()).is_ok());
            let idx = shift % spans.len();
            let mut bad = spans.clone();
            bad[idx].first_token += shift;
            prop_assert!(SpanPlan::new(g, buf, 0, end, bad).is_err());
            let mut bad = spans.clone();
            bad[idx].offset = buf;
            prop_assert!(SpanPlan::new(g, buf, 0, end, bad).is_err());
        }
    }
}
