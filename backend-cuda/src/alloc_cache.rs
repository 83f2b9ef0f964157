//! A cache of small device allocations for the per-op temporaries of decode (activations, GEMV
//! outputs, uploads of ids and positions): a decode step of the 27B model makes thousands of
//! them, and each `cuMemAllocAsync` / `cuMemFreeAsync` pair costs host time the GPU then waits
//! for. Sizes up to [`MAX_CACHED`] are rounded up to a power of two (at least [`MIN_CLASS`]); a
//! dropped allocation of such a class goes back to its free list (up to [`CACHE_CAP`] bytes in
//! all) instead of to the driver.
//!
//! Safety of reuse: every tensor, weight and scratch value is written and read on the backend's
//! compute stream only (the copy stream moves arena pages, never these), so work issued after a
//! reuse is ordered after all work on the previous owner, exactly as with a stream-ordered free.
//! `KVSTREAM_CUDA_ALLOC_CACHE=0` turns the cache off.

use cudarc::driver::CudaSlice;
use std::collections::HashMap;
use std::sync::Mutex;

/// Largest cached size class (bytes).
pub const MAX_CACHED: usize = 1 << 20;
/// Smallest size class (bytes).
pub const MIN_CLASS: usize = 256;
/// Most bytes held in free lists; beyond that, dropped allocations go back to the driver. (With
/// 64 MiB the H200 showed 128 MiB more device memory in use for the 27B q4 decode: too much
/// beside a 16 GiB card's plan; decode's working set of temporaries is a few MiB.)
pub const CACHE_CAP: usize = 8 << 20;
/// Environment switch (`0` disables the cache).
pub const ALLOC_CACHE_ENV: &str = "KVSTREAM_CUDA_ALLOC_CACHE";

/// The size class of a request of `bytes`, or `None` when it is not cached.
pub fn size_class(bytes: usize) -> Option<usize> {
    let class = bytes.max(MIN_CLASS).next_power_of_two();
    (class <= MAX_CACHED).then_some(class)
}

/// Whether the environment leaves the cache on (anything but `0`).
pub fn enabled_from_env() -> bool {
    !std::env::var(ALLOC_CACHE_ENV).is_ok_and(|v| v.trim() == "0")
}

/// Free lists by size class.
#[derive(Debug, Default)]
pub struct AllocCache {
    inner: Mutex<Lists>,
}

#[derive(Debug, Default)]
struct Lists {
    free: HashMap<usize, Vec<CudaSlice<u8>>>,
    held: usize,
}

impl AllocCache {
    /// A cached allocation of exactly `class` bytes, if one is free.
    pub fn take(&self, class: usize) -> Option<CudaSlice<u8>> {
        let mut l = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let s = l.free.get_mut(&class)?.pop()?;
        l.held -= class;
        Some(s)
    }

    /// Returns `slice` (of a cached class) to its free list; gives it back to the caller (to be
    /// freed) when the cache is full.
    pub fn give(&self, slice: CudaSlice<u8>) -> Option<CudaSlice<u8>> {
        let class = slice.len();
        let mut l = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if l.held + class > CACHE_CAP {
            return Some(slice);
        }
        l.held += class;
        l.free.entry(class).or_default().push(slice);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_within_bounds() {
        assert_eq!(size_class(0), Some(MIN_CLASS));
        assert_eq!(size_class(1), Some(MIN_CLASS));
        assert_eq!(size_class(256), Some(256));
        assert_eq!(size_class(257), Some(512));
        assert_eq!(size_class(20_480), Some(32_768));
        assert_eq!(size_class(MAX_CACHED), Some(MAX_CACHED));
        assert_eq!(size_class(MAX_CACHED + 1), None);
        for b in [3usize, 700, 5000, 99_999, 1 << 19] {
            let c = size_class(b).expect("class");
            assert!(c >= b && c.is_power_of_two() && c < 2 * b.max(MIN_CLASS));
        }
    }
}
