//! Pinned host memory and the host KV store (the authoritative history).
//!
//! [`HostBytes`] is a page-aligned, zero-initialised host allocation accessed only through raw
//! copies, never through long-lived references: like device memory, it may be read by a copy
//! engine while other bytes of it are written, and the fences of [`crate::transfer`] order
//! accesses to the same bytes. [`PinnedHost`] is how a backend makes such memory usable for
//! asynchronous transfers; [`PinnedBuffer`] couples an allocation with its RAII registration.
//! [`HostKvStore`] holds every attention layer's K and V history in page geometry.

use crate::arena::ContentGeneration;
use crate::backend::Backend;
use crate::error::HostError;
use crate::kv::geometry::PageGeometry;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment of host allocations (a 4 KiB page, what host registration wants).
pub const HOST_ALIGN: usize = 4096;

/// A page-aligned, zeroed host allocation with device-like access rules.
#[derive(Debug)]
pub struct HostBytes {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: HostBytes owns its allocation; all access goes through raw copies whose ordering the
// caller guarantees with fences (the same contract as device memory). No references into the
// allocation outlive a method call except through the `unsafe` accessors below.
unsafe impl Send for HostBytes {}
// SAFETY: see above.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// Allocates `len` zeroed bytes aligned to [`HOST_ALIGN`].
    pub fn new(len: usize) -> Result<Self, HostError> {
        let size = len.max(1).next_multiple_of(HOST_ALIGN);
        let layout = Layout::from_size_align(size, HOST_ALIGN).map_err(|e| HostError::Alloc {
            bytes: len,
            detail: e.to_string(),
        })?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| HostError::Alloc {
            bytes: len,
            detail: "out of host memory".into(),
        })?;
        Ok(Self { ptr, len, layout })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Base pointer (for backends registering or copying).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, n: usize) -> Result<(), HostError> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(HostError::Page {
                layer: 0,
                page: offset,
                pages: self.len,
            }),
        }
    }

    /// Copies `data` to `offset`. The caller must not race this with a reader of the same bytes.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), HostError> {
        self.check(offset, data.len())?;
        // SAFETY: range checked above; the source is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), HostError> {
        self.check(offset, out.len())?;
        // SAFETY: range checked above; `out` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// A shared view of `[offset, offset + n)`.
    ///
    /// # Safety
    /// No one may write these bytes while the returned slice is alive.
    pub unsafe fn slice(&self, offset: usize, n: usize) -> Result<&[u8], HostError> {
        self.check(offset, n)?;
        // SAFETY: range checked; the caller guarantees no concurrent writer.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), n) })
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// How a backend makes host memory usable for asynchronous transfers.
pub trait PinnedHost: Backend {
    /// Registers `bytes` (page-locks it for the device). Dropping the returned token
    /// unregisters. The CPU backend tracks ownership only.
    fn register_host(&self, bytes: &Arc<HostBytes>) -> Result<Self::HostRegistration, HostError>;
}

/// A host allocation and its registration. The registration drops first.
#[derive(Debug)]
pub struct PinnedBuffer<B: Backend> {
    registration: B::HostRegistration,
    bytes: Arc<HostBytes>,
}

impl<B: PinnedHost> PinnedBuffer<B> {
    /// Allocates and registers `len` bytes.
    pub fn new(backend: &B, len: usize) -> Result<Self, HostError> {
        let bytes = Arc::new(HostBytes::new(len)?);
        let registration = backend.register_host(&bytes)?;
        Ok(Self {
            registration,
            bytes,
        })
    }
}

impl<B: Backend> PinnedBuffer<B> {
    /// The memory (shared so in-flight copies keep it alive).
    pub fn bytes(&self) -> &Arc<HostBytes> {
        &self.bytes
    }
    /// The registration token.
    pub fn registration(&self) -> &B::HostRegistration {
        &self.registration
    }
}

/// A contiguous byte range of host memory (source or target of a transfer).
#[derive(Debug, Clone)]
pub struct HostRange {
    pub bytes: Arc<HostBytes>,
    pub offset: usize,
    pub len: usize,
}

/// The authoritative K/V history of every attention layer, in page geometry.
///
/// Layer `l` is one pinned allocation of `capacity_pages × page_bytes`; token `t` of layer `l`
/// has its K row at `page(t)·page_bytes + (t mod P)·k_row_bytes` and its V row in the page's V
/// plane. Nothing is ever dropped except by an explicit suffix truncation (speculative
/// rollback). Every append or truncation advances the [`ContentGeneration`].
#[derive(Debug)]
pub struct HostKvStore<B: Backend> {
    geometry: PageGeometry,
    capacity_tokens: usize,
    layers: Vec<PinnedBuffer<B>>,
    lens: Vec<usize>,
    generation: ContentGeneration,
}

impl<B: PinnedHost> HostKvStore<B> {
    /// Allocates and registers `layers` histories of `capacity_tokens` tokens each.
    pub fn new(
        backend: &B,
        geometry: PageGeometry,
        layers: usize,
        capacity_tokens: usize,
    ) -> Result<Self, HostError> {
        let bytes = geometry
            .pages_for(capacity_tokens)
            .checked_mul(geometry.page_bytes())
            .ok_or(HostError::Alloc {
                bytes: usize::MAX,
                detail: "size overflow".into(),
            })?;
        let layers_v = (0..layers)
            .map(|_| PinnedBuffer::new(backend, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            geometry,
            capacity_tokens,
            layers: layers_v,
            lens: vec![0; layers],
            generation: ContentGeneration(0),
        })
    }
}

impl<B: Backend> HostKvStore<B> {
    pub fn geometry(&self) -> &PageGeometry {
        &self.geometry
    }
    pub fn layers(&self) -> usize {
        self.layers.len()
    }
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_tokens
    }
    pub fn generation(&self) -> ContentGeneration {
        self.generation
    }
    /// Total pinned bytes held.
    pub fn pinned_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes().len()).sum()
    }

    fn layer(&self, layer: usize) -> Result<&PinnedBuffer<B>, HostError> {
        self.layers.get(layer).ok_or(HostError::Layer {
            layer,
            layers: self.layers.len(),
        })
    }

    /// Tokens held by `layer`.
    pub fn len(&self, layer: usize) -> Result<usize, HostError> {
        self.layer(layer)?;
        Ok(self.lens[layer])
    }

    /// The host memory of layer `layer`.
    pub fn layer_bytes(&self, layer: usize) -> Result<&Arc<HostBytes>, HostError> {
        Ok(self.layer(layer)?.bytes())
    }

    /// The byte range of pages `[first_page, first_page + n)` of `layer` (a transfer source).
    pub fn page_range(
        &self,
        layer: usize,
        first_page: usize,
        n: usize,
    ) -> Result<HostRange, HostError> {
        let l = self.layer(layer)?;
        let pages = self.geometry.pages_for(self.capacity_tokens);
        if first_page + n > pages {
            return Err(HostError::Page {
                layer,
                page: first_page + n,
                pages,
            });
        }
        let pb = self.geometry.page_bytes();
        Ok(HostRange {
            bytes: Arc::clone(l.bytes()),
            offset: first_page * pb,
            len: n * pb,
        })
    }

    /// Host byte offsets of token `t`'s K and V rows in `layer`.
    pub fn row_offsets(&self, t: usize) -> (usize, usize) {
        (
            self.geometry.k_row_offset(0, 0, t),
            self.geometry.v_row_offset(0, 0, t),
        )
    }

    fn check_append(&self, layer: usize, first: usize, n: usize) -> Result<(), HostError> {
        let len = self.len(layer)?;
        if first > len || first + n > self.capacity_tokens {
            return Err(HostError::Full {
                layer,
                len,
                capacity: self.capacity_tokens,
                adding: n,
            });
        }
        Ok(())
    }

    /// Writes encoded rows for tokens `[first, first + n)` (CPU path; `k` holds n K rows, `v` n V
    /// rows) and sets the layer's length to `first + n`. `first` may be below the current length
    /// only to overwrite a suffix (e.g. re-publishing the tail).
    pub fn write_rows(
        &mut self,
        layer: usize,
        first: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), HostError> {
        let kr = self.geometry.k_row_bytes();
        let vr = self.geometry.v_row_bytes();
        if k.len() % kr != 0 {
            return Err(HostError::RowBytes {
                got: k.len(),
                expected: kr,
            });
        }
        let n = k.len() / kr;
        if v.len() != n * vr {
            return Err(HostError::RowBytes {
                got: v.len(),
                expected: n * vr,
            });
        }
        self.check_append(layer, first, n)?;
        let bytes = Arc::clone(self.layer(layer)?.bytes());
        for i in 0..n {
            let (ko, vo) = self.row_offsets(first + i);
            bytes.write(ko, &k[i * kr..(i + 1) * kr])?;
            bytes.write(vo, &v[i * vr..(i + 1) * vr])?;
        }
        self.lens[layer] = first + n;
        self.generation = self.generation.next();
        Ok(())
    }

    /// Records that rows `[first, first + n)` of `layer` were written by a device→host
    /// publication (whose fence the caller tracks) and sets the length to `first + n`.
    pub fn commit_published(
        &mut self,
        layer: usize,
        first: usize,
        n: usize,
    ) -> Result<(), HostError> {
        self.check_append(layer, first, n)?;
        self.lens[layer] = first + n;
        self.generation = self.generation.next();
        Ok(())
    }

    /// Reads token `t`'s encoded K and V rows.
    pub fn read_row(
        &self,
        layer: usize,
        t: usize,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), HostError> {
        let len = self.len(layer)?;
        if t >= len {
            return Err(HostError::Truncate { layer, to: t, len });
        }
        let (ko, vo) = self.row_offsets(t);
        let b = self.layer(layer)?.bytes();
        b.read(ko, k)?;
        b.read(vo, v)
    }

    /// Drops the suffix `[to, len)` of `layer` (speculative rollback).
    pub fn truncate(&mut self, layer: usize, to: usize) -> Result<(), HostError> {
        let len = self.len(layer)?;
        if to > len {
            return Err(HostError::Truncate { layer, to, len });
        }
        if to < len {
            self.lens[layer] = to;
            self.generation = self.generation.next();
        }
        Ok(())
    }
}
