//! Page geometry: how one layer's K and V history is laid out in pages.
//!
//! A page holds `tokens_per_page` consecutive tokens of one layer. It is a K plane followed by a
//! separately aligned V plane; both planes are token-major (all KV heads of a token are
//! contiguous). The host history and every device page use the same geometry, so a run of
//! contiguous pages is one contiguous byte range that a single copy can move.

use crate::error::GeometryError;
use crate::kv::format::KvType;

/// Default plane alignment in bytes.
pub const DEFAULT_PLANE_ALIGN: usize = 256;

/// Validated page geometry of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageGeometry {
    tokens_per_page: usize,
    kv_heads: usize,
    head_dim: usize,
    k_type: KvType,
    v_type: KvType,
    plane_align: usize,
}

fn align_up(x: usize, a: usize) -> Option<usize> {
    x.checked_add(a - 1).map(|v| v & !(a - 1))
}

impl PageGeometry {
    /// Builds and validates a geometry.
    pub fn new(
        tokens_per_page: usize,
        kv_heads: usize,
        head_dim: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<Self, GeometryError> {
        Self::with_alignment(
            tokens_per_page,
            kv_heads,
            head_dim,
            k_type,
            v_type,
            DEFAULT_PLANE_ALIGN,
        )
    }

    /// As [`PageGeometry::new`] with an explicit plane alignment (power of two).
    pub fn with_alignment(
        tokens_per_page: usize,
        kv_heads: usize,
        head_dim: usize,
        k_type: KvType,
        v_type: KvType,
        plane_align: usize,
    ) -> Result<Self, GeometryError> {
        if tokens_per_page == 0 || !tokens_per_page.is_power_of_two() {
            return Err(GeometryError::TokensPerPage(tokens_per_page));
        }
        if kv_heads == 0 {
            return Err(GeometryError::Zero { field: "kv_heads" });
        }
        if head_dim == 0 {
            return Err(GeometryError::Zero { field: "head_dim" });
        }
        if plane_align == 0 || !plane_align.is_power_of_two() {
            return Err(GeometryError::Alignment(plane_align));
        }
        for ty in [k_type, v_type] {
            if head_dim % ty.block_values() != 0 {
                return Err(GeometryError::BlockStraddlesHead {
                    ty,
                    block: ty.block_values(),
                    head_dim,
                });
            }
        }
        let g = Self {
            tokens_per_page,
            kv_heads,
            head_dim,
            k_type,
            v_type,
            plane_align,
        };
        // Overflow check of the page size once; accessors below can then use plain arithmetic.
        g.checked_page_bytes().ok_or(GeometryError::Overflow)?;
        Ok(g)
    }

    fn checked_page_bytes(&self) -> Option<usize> {
        let k = self.head_bytes(self.k_type).checked_mul(self.kv_heads)?;
        let v = self.head_bytes(self.v_type).checked_mul(self.kv_heads)?;
        let kp = align_up(k.checked_mul(self.tokens_per_page)?, self.plane_align)?;
        let vp = align_up(v.checked_mul(self.tokens_per_page)?, self.plane_align)?;
        kp.checked_add(vp)
    }

    fn head_bytes(&self, ty: KvType) -> usize {
        self.head_dim / ty.block_values() * ty.block_bytes()
    }

    pub fn tokens_per_page(&self) -> usize {
        self.tokens_per_page
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn k_type(&self) -> KvType {
        self.k_type
    }
    pub fn v_type(&self) -> KvType {
        self.v_type
    }
    pub fn plane_align(&self) -> usize {
        self.plane_align
    }
    /// Values per token row of one plane (kv_heads × head_dim).
    pub fn row_values(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Bytes of one token's K row (all heads).
    pub fn k_row_bytes(&self) -> usize {
        self.head_bytes(self.k_type) * self.kv_heads
    }
    /// Bytes of one token's V row (all heads).
    pub fn v_row_bytes(&self) -> usize {
        self.head_bytes(self.v_type) * self.kv_heads
    }
    /// Bytes of one head inside a K row.
    pub fn k_head_bytes(&self) -> usize {
        self.head_bytes(self.k_type)
    }
    /// Bytes of one head inside a V row.
    pub fn v_head_bytes(&self) -> usize {
        self.head_bytes(self.v_type)
    }
    /// Bytes of the K plane of one page, including alignment padding.
    pub fn k_plane_bytes(&self) -> usize {
        (self.k_row_bytes() * self.tokens_per_page).next_multiple_of(self.plane_align)
    }
    /// Offset of the V plane inside a page.
    pub fn v_plane_offset(&self) -> usize {
        self.k_plane_bytes()
    }
    /// Bytes of the V plane of one page, including alignment padding.
    pub fn v_plane_bytes(&self) -> usize {
        (self.v_row_bytes() * self.tokens_per_page).next_multiple_of(self.plane_align)
    }
    /// Bytes of one page (K plane + V plane).
    pub fn page_bytes(&self) -> usize {
        self.k_plane_bytes() + self.v_plane_bytes()
    }
    /// Payload bytes per token and layer (K row + V row, no padding).
    pub fn bytes_per_token(&self) -> usize {
        self.k_row_bytes() + self.v_row_bytes()
    }
    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.tokens_per_page)
    }
    /// Byte offset, inside a run of pages starting at `base`, of token `t`'s K row, where the
    /// run's first page holds token `first` (a page boundary).
    pub fn k_row_offset(&self, base: usize, first: usize, t: usize) -> usize {
        let rel = t - first;
        base + rel / self.tokens_per_page * self.page_bytes()
            + rel % self.tokens_per_page * self.k_row_bytes()
    }
    /// As [`PageGeometry::k_row_offset`] for the V row.
    pub fn v_row_offset(&self, base: usize, first: usize, t: usize) -> usize {
        let rel = t - first;
        base + rel / self.tokens_per_page * self.page_bytes()
            + self.v_plane_offset()
            + rel % self.tokens_per_page * self.v_row_bytes()
    }
}

/// KV footprint of a whole model: `layers` attention layers of one geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvFootprint {
    pub geometry: PageGeometry,
    pub layers: usize,
}

impl KvFootprint {
    /// Payload bytes per token over all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.geometry.bytes_per_token() * self.layers
    }
    /// Paged bytes (with page and plane padding) for a context of `tokens` tokens.
    pub fn bytes_for_context(&self, tokens: usize) -> u64 {
        self.geometry.pages_for(tokens) as u64
            * self.geometry.page_bytes() as u64
            * self.layers as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen38_27b_q8_q4_page_matches_prior_art() {
        // 4 KV heads × 256, Q8_0 K / Q4_0 V, 256-token pages: 425,984 bytes per page.
        let g = PageGeometry::new(256, 4, 256, KvType::Q8_0, KvType::Q4_0).expect("valid");
        assert_eq!(g.k_row_bytes(), 4 * 272);
        assert_eq!(g.v_row_bytes(), 4 * 144);
        assert_eq!(g.page_bytes(), 425_984);
        assert_eq!(g.bytes_per_token(), 1664);
        let fp = KvFootprint {
            geometry: g,
            layers: 16,
        };
        assert_eq!(fp.bytes_per_token(), 26_624);
        assert_eq!(fp.bytes_for_context(262_144), 6_979_321_856);
        let bf = PageGeometry::new(256, 4, 256, KvType::Bf16, KvType::Bf16).expect("valid");
        let fp = KvFootprint {
            geometry: bf,
            layers: 16,
        };
        assert_eq!(fp.bytes_for_context(262_144), 17_179_869_184);
    }

    #[test]
    fn invalid_geometries_are_typed_errors() {
        assert_eq!(
            PageGeometry::new(100, 4, 256, KvType::F16, KvType::F16),
            Err(GeometryError::TokensPerPage(100))
        );
        assert!(matches!(
            PageGeometry::new(256, 4, 48, KvType::Q8_0, KvType::F16),
            Err(GeometryError::BlockStraddlesHead { .. })
        ));
        assert!(matches!(
            PageGeometry::new(256, 0, 64, KvType::F16, KvType::F16),
            Err(GeometryError::Zero { .. })
        ));
        assert!(matches!(
            PageGeometry::with_alignment(256, 4, 64, KvType::F16, KvType::F16, 3),
            Err(GeometryError::Alignment(3))
        ));
        assert!(matches!(
            PageGeometry::new(1 << 40, 1 << 20, 1 << 20, KvType::F32, KvType::F32),
            Err(GeometryError::Overflow)
        ));
    }

    #[test]
    fn v_plane_is_aligned_and_rows_do_not_overlap() {
        let g = PageGeometry::new(16, 1, 64, KvType::Q4_0, KvType::Bf16).expect("valid");
        assert_eq!(g.v_plane_offset() % g.plane_align(), 0);
        assert!(g.v_plane_offset() >= g.k_row_bytes() * 16);
        assert_eq!(
            g.k_row_offset(1000, 32, 32 + 17),
            1000 + g.page_bytes() + g.k_row_bytes()
        );
        assert_eq!(
            g.v_row_offset(0, 0, 3),
            g.v_plane_offset() + 3 * g.v_row_bytes()
        );
    }
}
