//! The phase arena: one parent allocation and a transactional map of the regions lent out of it.
//!
//! This module is pure metadata. A backend supplies the parent allocation (one device buffer) and
//! the pointer arithmetic; everything here decides *which bytes belong to whom*:
//!
//! * [`Arena::begin`] starts a staging layout (optionally carrying persistent regions forward),
//!   [`Staging::reserve`] adds a region first-fit, [`Staging::reserve_at`] at an exact offset,
//!   [`Arena::commit`] swaps the layout atomically and advances the [`ArenaGeneration`];
//!   dropping or [`Arena::rollback`]-ing a staging layout discards it.
//! * A [`View`] is (region, offset, len, generation); a view from an older generation is stale.
//! * A [`Lease`] (RAII) keeps a committed region alive: a commit that would move, resize or drop a
//!   leased region fails with [`ArenaError::LeasedRegionChanged`] and leaves the old layout in
//!   force. A lease proves ownership, **not** device completion: fences do that.

use crate::error::ArenaError;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};

macro_rules! generation_newtype {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub u64);
        impl $name {
            /// The next value.
            pub fn next(self) -> Self {
                Self(self.0 + 1)
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}#{}", stringify!($name), self.0)
            }
        }
    };
}

generation_newtype!(
    /// Advanced by every arena commit.
    ArenaGeneration
);
generation_newtype!(
    /// Advanced by every new device KV layout (placement) that is published.
    LayoutRevision
);
generation_newtype!(
    /// Advanced by every committed write to (or truncation of) the host KV history.
    ContentGeneration
);

/// Name of a region in the arena.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId(pub String);

impl From<&str> for RegionId {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}
impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A region of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub offset: usize,
    pub len: usize,
    pub align: usize,
    /// Carried forward by `begin(true)`.
    pub persistent: bool,
}

impl Region {
    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

/// A committed region's byte range, stamped with the generation it was committed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub region: RegionId,
    pub offset: usize,
    pub len: usize,
    pub generation: ArenaGeneration,
}

/// A staging layout under construction.
#[derive(Debug, Clone)]
pub struct Staging {
    capacity: usize,
    base: ArenaGeneration,
    regions: BTreeMap<RegionId, Region>,
}

fn check_align(align: usize) -> Result<(), ArenaError> {
    if align == 0 || !align.is_power_of_two() {
        return Err(ArenaError::Alignment(align));
    }
    Ok(())
}

impl Staging {
    fn sorted(&self) -> Vec<(&RegionId, &Region)> {
        let mut v: Vec<_> = self.regions.iter().collect();
        v.sort_by_key(|(_, r)| r.offset);
        v
    }

    /// Reserves `size` bytes aligned to `align` at the first gap that fits. Returns the offset.
    pub fn reserve(
        &mut self,
        id: impl Into<RegionId>,
        size: usize,
        align: usize,
        persistent: bool,
    ) -> Result<usize, ArenaError> {
        let id = id.into();
        check_align(align)?;
        if self.regions.contains_key(&id) {
            return Err(ArenaError::Duplicate(id.0));
        }
        let mut cursor = 0usize;
        let mut largest = 0usize;
        let mut found = None;
        let sorted = self.sorted();
        let mut gaps: Vec<(usize, usize)> = Vec::new();
        for (_, r) in &sorted {
            gaps.push((cursor, r.offset));
            cursor = cursor.max(r.end());
        }
        gaps.push((cursor, self.capacity));
        for (lo, hi) in gaps {
            let start = lo.next_multiple_of(align);
            largest = largest.max(hi.saturating_sub(lo));
            if start <= hi && hi - start >= size {
                found = Some(start);
                break;
            }
        }
        let Some(offset) = found else {
            return Err(ArenaError::OutOfSpace {
                region: id.0,
                size,
                align,
                capacity: self.capacity,
                free: largest,
            });
        };
        self.regions.insert(
            id,
            Region {
                offset,
                len: size,
                align,
                persistent,
            },
        );
        Ok(offset)
    }

    /// Reserves exactly `[offset, offset + size)`.
    pub fn reserve_at(
        &mut self,
        id: impl Into<RegionId>,
        offset: usize,
        size: usize,
        persistent: bool,
    ) -> Result<(), ArenaError> {
        let id = id.into();
        if self.regions.contains_key(&id) {
            return Err(ArenaError::Duplicate(id.0));
        }
        let end = offset.saturating_add(size);
        if end > self.capacity {
            return Err(ArenaError::Overlap {
                region: id.0,
                offset,
                end,
                other: "<arena end>".into(),
                capacity: self.capacity,
            });
        }
        for (other, r) in &self.regions {
            if offset < r.end() && r.offset < end {
                return Err(ArenaError::Overlap {
                    region: id.0,
                    offset,
                    end,
                    other: other.0.clone(),
                    capacity: self.capacity,
                });
            }
        }
        self.regions.insert(
            id,
            Region {
                offset,
                len: size,
                align: 1,
                persistent,
            },
        );
        Ok(())
    }

    /// Bytes not covered by any region.
    pub fn free_bytes(&self) -> usize {
        self.capacity - self.regions.values().map(|r| r.len).sum::<usize>()
    }

    /// Largest free gap (what the next `reserve` with alignment 1 could take).
    pub fn largest_gap(&self) -> usize {
        let mut cursor = 0usize;
        let mut largest = 0usize;
        for (_, r) in self.sorted() {
            largest = largest.max(r.offset.saturating_sub(cursor));
            cursor = cursor.max(r.end());
        }
        largest.max(self.capacity.saturating_sub(cursor))
    }

    /// The staged regions.
    pub fn regions(&self) -> &BTreeMap<RegionId, Region> {
        &self.regions
    }
}

/// The committed region map of one parent allocation of `capacity` bytes.
#[derive(Debug)]
pub struct Arena {
    capacity: usize,
    generation: ArenaGeneration,
    committed: BTreeMap<RegionId, Region>,
    leases: Arc<Mutex<HashMap<RegionId, usize>>>,
    high_water: usize,
}

/// RAII ownership of a committed region: while alive, no commit may change the region.
#[derive(Debug)]
pub struct Lease {
    region: RegionId,
    view: View,
    table: Arc<Mutex<HashMap<RegionId, usize>>>,
}

impl Lease {
    /// The leased view.
    pub fn view(&self) -> &View {
        &self.view
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A poisoned table only means another thread panicked while holding it; the counts stay
        // meaningful, so recover the guard instead of propagating the panic.
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = t.get_mut(&self.region) {
            *c -= 1;
            if *c == 0 {
                t.remove(&self.region);
            }
        }
    }
}

impl Arena {
    /// A new arena with an empty committed layout.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            generation: ArenaGeneration(0),
            committed: BTreeMap::new(),
            leases: Arc::new(Mutex::new(HashMap::new())),
            high_water: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn generation(&self) -> ArenaGeneration {
        self.generation
    }
    /// Largest number of bytes any committed layout has used.
    pub fn high_water(&self) -> usize {
        self.high_water
    }
    /// Bytes used by the committed layout.
    pub fn used(&self) -> usize {
        self.committed.values().map(|r| r.len).sum()
    }
    /// Committed regions.
    pub fn regions(&self) -> &BTreeMap<RegionId, Region> {
        &self.committed
    }

    /// Starts a staging layout; with `carry_persistent`, persistent regions keep their place.
    pub fn begin(&self, carry_persistent: bool) -> Staging {
        let regions = if carry_persistent {
            self.committed
                .iter()
                .filter(|(_, r)| r.persistent)
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        } else {
            BTreeMap::new()
        };
        Staging {
            capacity: self.capacity,
            base: self.generation,
            regions,
        }
    }

    /// Atomically replaces the committed layout with `staging`.
    ///
    /// Fails (leaving the old layout in force) if the staging was begun at another generation or
    /// if it moves, resizes or drops a leased region.
    pub fn commit(&mut self, staging: Staging) -> Result<ArenaGeneration, ArenaError> {
        if staging.base != self.generation {
            return Err(ArenaError::StaleStaging {
                staged: staging.base.0,
                current: self.generation.0,
            });
        }
        {
            let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            for id in leases.keys() {
                let old = self.committed.get(id);
                let new = staging.regions.get(id);
                let same = matches!((old, new), (Some(a), Some(b)) if a.offset == b.offset && a.len == b.len);
                if !same {
                    return Err(ArenaError::LeasedRegionChanged(id.0.clone()));
                }
            }
        }
        self.committed = staging.regions;
        self.generation = self.generation.next();
        self.high_water = self.high_water.max(self.used());
        tracing::debug!(
            generation = self.generation.0,
            used = self.used(),
            "arena commit"
        );
        Ok(self.generation)
    }

    /// Discards a staging layout (same as dropping it; spelled out for readability).
    pub fn rollback(&self, staging: Staging) {
        drop(staging);
    }

    /// The committed view of `id`.
    pub fn view(&self, id: &str) -> Result<View, ArenaError> {
        let key = RegionId::from(id);
        let r = self
            .committed
            .get(&key)
            .ok_or_else(|| ArenaError::NoSuchRegion(id.to_string()))?;
        Ok(View {
            region: key,
            offset: r.offset,
            len: r.len,
            generation: self.generation,
        })
    }

    /// Checks that `view` belongs to the current generation.
    pub fn check_view(&self, view: &View) -> Result<(), ArenaError> {
        if view.generation != self.generation {
            // A view survives a commit only if its region is unchanged.
            match self.committed.get(&view.region) {
                Some(r) if r.offset == view.offset && r.len == view.len => return Ok(()),
                _ => {
                    return Err(ArenaError::StaleView {
                        region: view.region.0.clone(),
                        view: view.generation.0,
                        current: self.generation.0,
                    })
                }
            }
        }
        Ok(())
    }

    /// Leases the committed region `id`.
    pub fn lease(&self, id: &str) -> Result<Lease, ArenaError> {
        let view = self.view(id)?;
        let mut t = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        *t.entry(view.region.clone()).or_insert(0) += 1;
        Ok(Lease {
            region: view.region.clone(),
            view,
            table: Arc::clone(&self.leases),
        })
    }

    /// Number of live leases on `id`.
    pub fn lease_count(&self, id: &str) -> usize {
        let t = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        t.get(&RegionId::from(id)).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_first_fit_and_commit_advances_generation() {
        let mut a = Arena::new(1000);
        let mut s = a.begin(false);
        assert_eq!(s.reserve("ws", 100, 64, false).ok(), Some(0));
        assert_eq!(s.reserve("pool", 300, 256, true).ok(), Some(256));
        assert_eq!(s.reserve("scratch", 100, 1, false).ok(), Some(100));
        let g0 = a.generation();
        let g1 = a.commit(s).expect("commit");
        assert_eq!(g1, g0.next());
        assert_eq!(a.view("pool").map(|v| v.offset).ok(), Some(256));
        assert_eq!(a.used(), 500);
    }

    #[test]
    fn out_of_space_names_region_and_free_bytes() {
        let a = Arena::new(1000);
        let mut s = a.begin(false);
        s.reserve("a", 600, 1, false).expect("fits");
        match s.reserve("b", 500, 1, false) {
            Err(ArenaError::OutOfSpace { region, free, .. }) => {
                assert_eq!(region, "b");
                assert_eq!(free, 400);
            }
            other => panic!("expected OutOfSpace, got {other:?}"),
        }
    }

    #[test]
    fn reserve_at_rejects_overlaps_and_duplicates() {
        let a = Arena::new(1000);
        let mut s = a.begin(false);
        s.reserve_at("a", 100, 100, false).expect("ok");
        assert!(matches!(
            s.reserve_at("b", 150, 10, false),
            Err(ArenaError::Overlap { .. })
        ));
        assert!(matches!(
            s.reserve_at("c", 990, 20, false),
            Err(ArenaError::Overlap { .. })
        ));
        assert!(matches!(
            s.reserve_at("a", 500, 1, false),
            Err(ArenaError::Duplicate(_))
        ));
        assert_eq!(s.reserve("d", 100, 1, false).ok(), Some(0));
        assert!(matches!(
            s.reserve("e", 10, 3, false),
            Err(ArenaError::Alignment(3))
        ));
    }

    #[test]
    fn leased_region_cannot_change_but_survives_unchanged() {
        let mut a = Arena::new(1000);
        let mut s = a.begin(false);
        s.reserve("pool", 400, 1, true).expect("ok");
        s.reserve("ws", 200, 1, false).expect("ok");
        a.commit(s).expect("commit");
        let lease = a.lease("pool").expect("lease");
        assert_eq!(a.lease_count("pool"), 1);

        // Dropping the leased region fails and leaves the old layout.
        let mut s = a.begin(false);
        s.reserve("ws", 900, 1, false).expect("ok");
        let gen = a.generation();
        assert_eq!(
            a.commit(s),
            Err(ArenaError::LeasedRegionChanged("pool".into()))
        );
        assert_eq!(a.generation(), gen);
        assert_eq!(a.view("ws").map(|v| v.len).ok(), Some(200));

        // Carrying it forward unchanged is fine, and the old view stays valid.
        let mut s = a.begin(true);
        s.reserve("ws2", 500, 1, false).expect("ok");
        a.commit(s).expect("commit");
        a.check_view(lease.view())
            .expect("unchanged region keeps its view");
        assert!(matches!(a.view("ws"), Err(ArenaError::NoSuchRegion(_))));

        drop(lease);
        assert_eq!(a.lease_count("pool"), 0);
        let s = a.begin(false);
        a.commit(s).expect("no lease: may drop pool");
    }

    #[test]
    fn stale_staging_and_views_are_rejected() {
        let mut a = Arena::new(100);
        let s1 = a.begin(false);
        let mut s2 = a.begin(false);
        s2.reserve("x", 10, 1, false).expect("ok");
        a.commit(s2).expect("ok");
        let v = a.view("x").expect("view");
        assert!(matches!(a.commit(s1), Err(ArenaError::StaleStaging { .. })));
        let mut s3 = a.begin(false);
        s3.reserve("x", 20, 1, false).expect("ok");
        a.commit(s3).expect("ok");
        assert!(matches!(
            a.check_view(&v),
            Err(ArenaError::StaleView { .. })
        ));
        let s4 = a.begin(false);
        a.rollback(s4);
        assert_eq!(a.high_water(), 20);
    }
}
