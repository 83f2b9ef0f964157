//! The ring-slot scheduler: FIFO ownership of ring slots and the order of wave copies.
//!
//! A step plans one [`WaveJob`] per group of at most [`RingScheduler::wave_pages`] streamed pages
//! (half the ring: double buffering, so the copy of wave `i + 1` runs while wave `i` is attended),
//! for every streamed layer in layer order. Jobs are issued strictly in that order, each as soon as enough
//! slots are free; a job takes the next slots of the ring in FIFO order (at most two runs: before
//! and after the wrap, so a span never wraps). A slot is free again once its consumer has
//! *recorded* its consumed fence; a refill of that slot waits on that fence (and on the
//! publication of any rows written into it), never on work that has not been enqueued yet, so the
//! copy queue cannot deadlock behind the compute queue. Lookahead is bounded by free slots, not
//! by a number of layers: while layer `L` computes, the copy engine fills the slots for the next
//! streamed layers.

use crate::placement::RingRun;
use std::collections::VecDeque;

/// A group of consecutive streamed pages of one layer that are attended in one wave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaveJob {
    /// Attention layer.
    pub layer: usize,
    /// First page of the wave.
    pub first_page: usize,
    /// Pages in the wave (1..=ring slots).
    pub pages: usize,
}

/// A job whose copies have been enqueued.
#[derive(Debug, Clone)]
pub struct IssuedWave<F> {
    /// The job.
    pub job: WaveJob,
    /// Its slots, in page order (one or two runs).
    pub runs: Vec<RingRun>,
    /// Ready fences of its copies (one per copy request; empty if nothing had to be copied).
    pub ready: Vec<F>,
}

/// FIFO slot ownership and the job queue of the current step.
#[derive(Debug)]
pub struct RingScheduler<F> {
    slots: usize,
    alloc: u64,
    freed: u64,
    slot_waits: Vec<Vec<F>>,
    queue: VecDeque<WaveJob>,
    issued: VecDeque<IssuedWave<F>>,
    peak_in_use: usize,
}

impl<F: Clone> RingScheduler<F> {
    /// A scheduler for `slots` ring slots, all free.
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            alloc: 0,
            freed: 0,
            slot_waits: vec![Vec::new(); slots],
            queue: VecDeque::new(),
            issued: VecDeque::new(),
            peak_in_use: 0,
        }
    }

    /// Ring slots.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Slots not owned by an issued, unconsumed wave.
    pub fn free_slots(&self) -> usize {
        self.slots - (self.alloc - self.freed) as usize
    }
    /// Highest number of slots in use at once since the last [`RingScheduler::take_peak`].
    pub fn take_peak(&mut self) -> usize {
        std::mem::take(&mut self.peak_in_use)
    }
    /// Jobs planned but not issued.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }
    /// Waves issued but not consumed.
    pub fn in_flight(&self) -> usize {
        self.issued.len()
    }

    /// Most pages in one wave: half the ring (at least 1). Two waves then fit in the ring at
    /// once, so the copy engine fills one half while attention reads the other; a wave as large
    /// as the ring would make every copy wait for the previous wave's attention (no overlap).
    pub fn wave_pages(&self) -> usize {
        (self.slots / 2).max(1)
    }

    /// Splits the streamed pages `[first, end)` of `layer` into waves of at most
    /// [`RingScheduler::wave_pages`] pages and appends them to the queue.
    pub fn plan_layer(&mut self, layer: usize, first: usize, end: usize) {
        let mut p = first;
        let cap = self.wave_pages();
        while p < end && self.slots > 0 {
            let n = (end - p).min(cap);
            self.queue.push_back(WaveJob {
                layer,
                first_page: p,
                pages: n,
            });
            p += n;
        }
    }

    /// The next job if enough slots are free for it, with its runs and the fences its copies must
    /// wait for (the consumed/publication fences of the slots' previous owners).
    pub fn next_issuable(&self) -> Option<(WaveJob, Vec<RingRun>, Vec<F>)> {
        let job = *self.queue.front()?;
        if job.pages > self.free_slots() {
            return None;
        }
        let start = (self.alloc % self.slots as u64) as usize;
        let first_len = job.pages.min(self.slots - start);
        let mut runs = vec![RingRun {
            first_page: job.first_page,
            pages: first_len,
            first_slot: start,
        }];
        if first_len < job.pages {
            runs.push(RingRun {
                first_page: job.first_page + first_len,
                pages: job.pages - first_len,
                first_slot: 0,
            });
        }
        let waits = runs
            .iter()
            .flat_map(|r| r.first_slot..r.first_slot + r.pages)
            .flat_map(|s| self.slot_waits[s].iter().cloned())
            .collect();
        Some((job, runs, waits))
    }

    /// Records that the front job was issued with `ready` fences.
    pub fn mark_issued(&mut self, runs: Vec<RingRun>, ready: Vec<F>) {
        if let Some(job) = self.queue.pop_front() {
            self.alloc += job.pages as u64;
            for r in &runs {
                for s in r.first_slot..r.first_slot + r.pages {
                    self.slot_waits[s].clear();
                }
            }
            let in_use = (self.alloc - self.freed) as usize;
            self.peak_in_use = self.peak_in_use.max(in_use);
            self.issued.push_back(IssuedWave { job, runs, ready });
        }
    }

    /// Takes the oldest issued wave if it belongs to `layer` (waves are consumed in issue order).
    pub fn take(&mut self, layer: usize) -> Option<IssuedWave<F>> {
        if self.issued.front().is_some_and(|w| w.job.layer == layer) {
            self.issued.pop_front()
        } else {
            None
        }
    }

    /// True if the next wave to consume (issued or queued) belongs to `layer`.
    pub fn next_is(&self, layer: usize) -> bool {
        self.issued
            .front()
            .map(|w| w.job)
            .or_else(|| self.queue.front().copied())
            .is_some_and(|j| j.layer == layer)
    }

    /// Frees a consumed wave's slots; their next fill waits on `fences`.
    pub fn release(&mut self, wave: &IssuedWave<F>, fences: &[F]) {
        for r in &wave.runs {
            for s in r.first_slot..r.first_slot + r.pages {
                self.slot_waits[s] = fences.to_vec();
            }
        }
        self.freed += wave.job.pages as u64;
    }

    /// Every fence the scheduler still tracks (issued ready fences and slot waits), for draining.
    pub fn outstanding(&self) -> Vec<F> {
        self.issued
            .iter()
            .flat_map(|w| w.ready.iter().cloned())
            .chain(self.slot_waits.iter().flatten().cloned())
            .collect()
    }

    /// Forgets everything (after a drain): all slots free, nothing queued.
    pub fn reset(&mut self, slots: usize) {
        *self = Self::new(slots);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_ownership_wraps_into_two_runs_and_waits_on_previous_owner() {
        // 6 slots → waves of at most 3 pages.
        let mut r: RingScheduler<u32> = RingScheduler::new(6);
        r.plan_layer(0, 2, 4); // 2 pages
        r.plan_layer(1, 0, 6); // 3 + 3 pages
        let (job, runs, waits) = r.next_issuable().expect("room");
        assert_eq!((job.layer, job.pages), (0, 2));
        assert_eq!(runs.len(), 1);
        assert!(waits.is_empty());
        r.mark_issued(runs, vec![10]);
        let (job, runs, _) = r.next_issuable().expect("room for layer 1's first wave");
        assert_eq!((job.layer, job.first_page, job.pages), (1, 0, 3));
        r.mark_issued(runs, vec![11]);
        // Layer 1's second wave needs 3 slots, only 1 free: not issuable (bounded lookahead).
        assert!(r.next_issuable().is_none());
        assert!(r.take(1).is_none(), "consumption is in issue order");
        let w = r.take(0).expect("front");
        assert_eq!(w.ready, vec![10]);
        r.release(&w, &[77]);
        let (job, runs, waits) = r.next_issuable().expect("room after release");
        assert_eq!((job.layer, job.first_page), (1, 3));
        assert_eq!(runs.len(), 2, "slot 5 then slots 0..2");
        assert_eq!((runs[0].first_slot, runs[0].pages), (5, 1));
        assert_eq!((runs[1].first_slot, runs[1].pages), (0, 2));
        assert_eq!(runs[1].first_page, 4);
        assert_eq!(
            waits,
            vec![77, 77],
            "slots 0 and 1 wait on the consumed fence, fresh slot 5 on nothing"
        );
        r.mark_issued(runs, vec![]);
        assert_eq!(r.take_peak(), 6);
    }

    #[test]
    fn waves_are_half_the_ring_and_never_exceed_it() {
        for (slots, expect) in [
            (1usize, vec![1usize; 8]),
            (3, vec![1; 8]),
            (6, vec![3, 3, 2]),
        ] {
            let mut r: RingScheduler<()> = RingScheduler::new(slots);
            r.plan_layer(0, 0, 8);
            let mut pages = Vec::new();
            while r.queued() > 0 {
                let (job, runs, _) = r.next_issuable().expect("empty ring has room");
                assert!(job.pages <= slots);
                pages.push(job.pages);
                r.mark_issued(runs, vec![]);
                let w = r.take(0).expect("front");
                r.release(&w, &[]);
            }
            assert_eq!(pages, expect, "{slots} slots");
        }
    }

    #[test]
    fn next_wave_is_issued_before_the_current_one_is_consumed() {
        // Double buffering: with 8 slots a long layer is cut into 4-page waves, and the second
        // wave's copy can be issued while the first one is still unconsumed.
        let mut r: RingScheduler<u32> = RingScheduler::new(8);
        r.plan_layer(0, 0, 20);
        let (job, runs, _) = r.next_issuable().expect("room");
        assert_eq!(job.pages, 4);
        r.mark_issued(runs, vec![1]);
        let (job2, runs2, waits2) = r.next_issuable().expect("second half of the ring is free");
        assert_eq!((job2.first_page, job2.pages), (4, 4));
        assert!(waits2.is_empty(), "fresh slots wait on nothing");
        r.mark_issued(runs2, vec![2]);
        assert!(
            r.next_issuable().is_none(),
            "third wave waits for the first to be consumed"
        );
        let w = r.take(0).expect("front");
        r.release(&w, &[9]);
        let (_, _, waits3) = r.next_issuable().expect("first half free again");
        assert_eq!(waits3, vec![9; 4], "refill waits on the consumed fence");
    }
}
