//! Offsets inside a lent arena region: the allocator a backend uses while an arena region is lent
//! to it ([`crate::transfer::DeviceMemory::begin_region_allocations`]), e.g. for the vision
//! tower's weights and activations during an image encode. First fit over a sorted free list,
//! neighbours coalesced on free, every offset a multiple of the alignment. Pure bookkeeping (no
//! memory is touched), so it is tested without a device.

use std::collections::BTreeMap;

/// First-fit offset allocator over `[0, len)`.
#[derive(Debug, Clone)]
pub struct RegionAllocator {
    len: usize,
    align: usize,
    /// Free ranges by offset → length (disjoint, never adjacent: adjacent ranges are merged).
    free: BTreeMap<usize, usize>,
    live_bytes: usize,
    live_count: usize,
    peak_bytes: usize,
}

impl RegionAllocator {
    /// An allocator of `len` bytes handing out offsets aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> Self {
        let align = align.max(1).next_power_of_two();
        let usable = len - len % align;
        let mut free = BTreeMap::new();
        if usable > 0 {
            free.insert(0, usable);
        }
        Self {
            len: usable,
            align,
            free,
            live_bytes: 0,
            live_count: 0,
            peak_bytes: 0,
        }
    }

    /// Size the allocator reserves for a request of `bytes` (rounded up to the alignment, at
    /// least one unit). `None` on overflow.
    pub fn reserved_size(&self, bytes: usize) -> Option<usize> {
        bytes.max(1).checked_next_multiple_of(self.align)
    }

    /// Reserves `bytes` and returns the offset, or `None` when no free range is large enough.
    /// Release it with [`RegionAllocator::free`] and the same `bytes`.
    pub fn alloc(&mut self, bytes: usize) -> Option<usize> {
        let size = self.reserved_size(bytes)?;
        let (&off, &len) = self.free.iter().find(|(_, &l)| l >= size)?;
        self.free.remove(&off);
        if len > size {
            self.free.insert(off + size, len - size);
        }
        self.live_bytes += size;
        self.live_count += 1;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        Some(off)
    }

    /// Returns `[offset, offset + bytes)` (as reserved by [`RegionAllocator::alloc`]) to the free
    /// list, merging it with free neighbours.
    pub fn free(&mut self, offset: usize, bytes: usize) {
        let Some(size) = self.reserved_size(bytes) else {
            return;
        };
        let (mut start, mut len) = (offset, size);
        if let Some((&p_off, &p_len)) = self.free.range(..offset).next_back() {
            if p_off + p_len == offset {
                self.free.remove(&p_off);
                start = p_off;
                len += p_len;
            }
        }
        if let Some(&n_len) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += n_len;
        }
        self.free.insert(start, len);
        self.live_bytes = self.live_bytes.saturating_sub(size);
        self.live_count = self.live_count.saturating_sub(1);
    }

    /// Usable bytes (the region's length rounded down to the alignment).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the region holds nothing usable.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes reserved by live allocations.
    pub fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// Number of live allocations.
    pub fn live_count(&self) -> usize {
        self.live_count
    }

    /// Most bytes live at once since creation.
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes
    }

    /// Largest request that would succeed now.
    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }
}

/// What a region loan held, reported when it ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionLoanReport {
    /// Bytes of the lent region.
    pub region_bytes: usize,
    /// Most bytes live at once inside it.
    pub peak_bytes: usize,
    /// Allocations still alive when the loan ended (must be 0 before the region is reused).
    pub live_count: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_fit_reuses_and_coalesces() {
        let mut r = RegionAllocator::new(4096, 256);
        let a = r.alloc(100).expect("a");
        let b = r.alloc(300).expect("b");
        let c = r.alloc(256).expect("c");
        assert_eq!((a, b, c), (0, 256, 768));
        assert_eq!(r.live_bytes(), 256 + 512 + 256);
        r.free(b, 300);
        // The hole of b is reused first.
        assert_eq!(r.alloc(200), Some(256));
        r.free(256, 200);
        r.free(a, 100);
        r.free(c, 256);
        assert_eq!(r.live_count(), 0);
        assert_eq!(
            r.largest_free(),
            4096,
            "everything merged back into one range"
        );
        assert_eq!(r.peak_bytes(), 1024);
    }

    #[test]
    fn too_large_or_full_is_none() {
        let mut r = RegionAllocator::new(1000, 256);
        assert_eq!(r.len(), 768);
        assert_eq!(r.alloc(769), None);
        assert_eq!(r.alloc(768), Some(0));
        assert_eq!(r.alloc(1), None);
        assert!(RegionAllocator::new(100, 256).is_empty());
    }

    proptest! {
        /// Random alloc/free sequences: live ranges never overlap, stay inside the region and
        /// aligned; after freeing everything the region is one free range again.
        #[test]
        fn live_ranges_are_disjoint_and_everything_merges_back(
            ops in proptest::collection::vec((any::<bool>(), 1usize..3000, any::<u16>()), 1..200)
        ) {
            let mut r = RegionAllocator::new(64 * 1024, 256);
            let mut live: Vec<(usize, usize)> = Vec::new();
            for (alloc, bytes, pick) in ops {
                if alloc || live.is_empty() {
                    if let Some(off) = r.alloc(bytes) {
                        let size = r.reserved_size(bytes).expect("size");
                        prop_assert_eq!(off % 256, 0);
                        prop_assert!(off + size <= r.len());
                        for &(o, b) in &live {
                            let s = r.reserved_size(b).expect("size");
                            prop_assert!(off + size <= o || o + s <= off, "overlap");
                        }
                        live.push((off, bytes));
                    }
                } else {
                    let (o, b) = live.swap_remove(pick as usize % live.len());
                    r.free(o, b);
                }
                prop_assert_eq!(r.live_count(), live.len());
            }
            for (o, b) in live.drain(..) {
                r.free(o, b);
            }
            prop_assert_eq!(r.live_bytes(), 0);
            prop_assert_eq!(r.largest_free(), r.len());
        }
    }
}
