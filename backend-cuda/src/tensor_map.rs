//! Tensor maps (Hopper TMA descriptors) for the fast attention kernel's K/V chunk copies
//! (`FA_TMA` in attention.cu): one map per plane and span, so each 64-token chunk of one KV head
//! arrives as one `cp.async.bulk.tensor.3d` issued by one thread instead of ~1,700 16-byte
//! `cp.async` copies walked by the whole block.
//!
//! The plane of a span is a 3-D array of u32 words: dim 0 the words of one token row (all KV heads),
//! dim 1 the tokens of a page (stride: the row), dim 2 the span's pages (stride: the page). A box is
//! one head's words × 64 tokens × 1 page, landing densely as `[64][head bytes]` in shared memory.
//! Encoding is a host-side driver call (no GPU work), so a CUDA-graph capture records the map by
//! value with the launch.

use cudarc::driver::sys;
use kvstream_memory_contracts::kv::geometry::PageGeometry;

/// A CUtensorMap passed by value as a `__grid_constant__` kernel parameter (`FaTmap` in
/// attention.cu: 128 opaque bytes).
pub(crate) type TensorMap = sys::CUtensorMap;

/// An all-zero map: the parameter value of launches that do not use tensor copies.
pub(crate) fn unused_map() -> TensorMap {
    sys::CUtensorMap { opaque: [0; 16] }
}

/// The geometry of one plane's map, checked against the hardware's rules before encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlaneMap {
    /// Device address of the span's first row of this plane.
    pub base: u64,
    /// Bytes of one token row (all KV heads).
    pub row_bytes: u64,
    /// Bytes of one head's row: the box's inner extent.
    pub head_bytes: u64,
    /// Tokens per page.
    pub tokens: u64,
    /// Pages of the span.
    pub pages: u64,
    /// Bytes from one page to the next.
    pub page_bytes: u64,
    /// Tokens per box (the kernel's chunk).
    pub box_tokens: u32,
}

impl PlaneMap {
    /// The K (`v = false`) or V plane of a span starting at device address `span_base` and holding
    /// `tokens` tokens, boxes of `box_tokens` tokens.
    pub(crate) fn of_span(
        g: &PageGeometry,
        span_base: u64,
        tokens: usize,
        v: bool,
        box_tokens: u32,
    ) -> Self {
        let (off, row, head) = if v {
            (g.v_plane_offset(), g.v_row_bytes(), g.v_head_bytes())
        } else {
            (0, g.k_row_bytes(), g.k_head_bytes())
        };
        Self {
            base: span_base + off as u64,
            row_bytes: row as u64,
            head_bytes: head as u64,
            tokens: g.tokens_per_page() as u64,
            pages: tokens.div_ceil(g.tokens_per_page().max(1)).max(1) as u64,
            page_bytes: g.page_bytes() as u64,
            box_tokens,
        }
    }

    /// Why the TMA unit cannot copy this plane's boxes, if it cannot: addresses and strides must be
    /// 16-byte multiples, a box dimension at most 256 elements (u32 words) and its inner extent a
    /// 16-byte multiple, the box no taller than a page.
    pub(crate) fn unsupported(&self) -> Option<String> {
        let words = self.head_bytes / 4;
        let checks = [
            (self.base % 16 == 0, "base address not 16-byte aligned"),
            (
                self.row_bytes % 16 == 0,
                "row stride not a 16-byte multiple",
            ),
            (
                self.page_bytes % 16 == 0,
                "page stride not a 16-byte multiple",
            ),
            (self.head_bytes % 16 == 0, "head row not a 16-byte multiple"),
            ((1..=256).contains(&words), "head row over 256 words"),
            (
                (1..=256).contains(&self.box_tokens) && u64::from(self.box_tokens) <= self.tokens,
                "box taller than 256 rows or a page",
            ),
            (
                self.page_bytes >= self.row_bytes * self.tokens,
                "page shorter than its rows",
            ),
            (self.page_bytes < 1 << 40, "page stride too large"),
        ];
        checks
            .iter()
            .find(|(ok, _)| !ok)
            .map(|(_, why)| (*why).to_string())
    }

    /// Encodes the map (the caller's context must be current on this thread).
    pub(crate) fn encode(&self) -> Result<TensorMap, String> {
        if let Some(why) = self.unsupported() {
            return Err(why);
        }
        let mut map = unused_map();
        let dims: [u64; 3] = [self.row_bytes / 4, self.tokens, self.pages];
        let strides: [u64; 2] = [self.row_bytes, self.page_bytes];
        let boxes: [u32; 3] = [(self.head_bytes / 4) as u32, self.box_tokens, 1];
        let elem: [u32; 3] = [1, 1, 1];
        // SAFETY: every pointer refers to a live local array of the rank's length; the driver
        // writes only the 128-byte map.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT32,
                3,
                self.base as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(map)
        } else {
            Err(format!("cuTensorMapEncodeTiled: {r:?}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::kv::format::KvType;

    fn q8q4(head_dim: usize, tpp: usize) -> PageGeometry {
        PageGeometry::new(tpp, 4, head_dim, KvType::Q8_0, KvType::Q4_0).expect("geometry")
    }

    #[test]
    fn the_27b_planes_fit_the_tma_rules() {
        let g = q8q4(256, 256);
        let k = PlaneMap::of_span(&g, 1 << 20, 1000, false, 64);
        assert_eq!(k.unsupported(), None, "{k:?}");
        assert_eq!((k.head_bytes, k.row_bytes, k.pages), (272, 1088, 4));
        let v = PlaneMap::of_span(&g, 1 << 20, 256, true, 64);
        assert_eq!(v.unsupported(), None, "{v:?}");
        assert_eq!(v.base, (1 << 20) + g.v_plane_offset() as u64);
        assert_eq!((v.head_bytes, v.pages), (144, 1));
    }

    #[test]
    fn misaligned_or_oversized_planes_are_refused() {
        // head_dim 128: 136-byte K head rows are not 16-byte multiples.
        let g = q8q4(128, 256);
        assert!(PlaneMap::of_span(&g, 0, 256, false, 64)
            .unsupported()
            .is_some());
        let g = q8q4(256, 256);
        assert!(PlaneMap::of_span(&g, 8, 256, false, 64)
            .unsupported()
            .is_some_and(|w| w.contains("base")));
        // A box taller than the page.
        let small = q8q4(256, 64);
        assert!(PlaneMap::of_span(&small, 0, 64, true, 128)
            .unsupported()
            .is_some_and(|w| w.contains("box")));
    }
}
