//! The adaptive placement policy: a pure function from (configuration, state, observation) to a
//! device KV layout.
//!
//! The device pool holds `P` pages. Each attention layer `l` gets `resident[l]` resident pages
//! and all layers share one ring of `ring_slots` slots; the invariant is
//! `Σ resident + ring_slots = P` (no hidden reserve). A layer whose active pages exceed its
//! resident pages *streams* the rest through the ring.
//!
//! * **Fits ⇒ no ring traffic.** When every layer's active pages fit (plus the minimum ring), the
//!   decision gives every layer the same, maximal resident quota (headroom to grow without a new
//!   layout), so nothing streams.
//! * **Concentrated streaming.** Under pressure the fewest possible layers stream (`S` minimal);
//!   the others stay fully resident and serve as prefetch windows. Streamed layers are spread at
//!   ordinals `⌊j·L/S⌋`. Their resident quota is the largest one whose ring still covers
//!   `overlap × deficit` of one streamed layer (one wave per layer); if none does, the ring gets
//!   the share `(overlap − 1) / overlap` of the streamed layers' space (several waves).
//! * **Hysteresis.** Under pressure a new layout is adopted only after the current one has been
//!   worse than the ideal by more than `hysteresis_pages` for `grow_after` evaluations and
//!   `cooldown` evaluations have passed since the last change. Feedback (ready misses while the
//!   copy engine is idle → bigger ring; copy engine saturated → smaller ring) retunes the overlap
//!   factor, again with streaks and cooldown, so the layout does not oscillate. A ring that
//!   stays under half full without misses counts like a saturated copy engine (shallower ring).
//!
//! [`decide`] never mutates anything: it returns the proposal and the state to keep *if* the
//! device accepts the proposal. A rejected proposal is simply dropped; the old state stays.

use serde::{Deserialize, Serialize};

/// What the pool is used for right now (an input; never inferred from a batch size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyPhase {
    /// Prompt chunks: many queries, pages grow by a chunk per step.
    Prefill,
    /// One query per step; the only phase whose feedback retunes the policy.
    Decode,
    /// A few queries (speculative verification).
    Verify,
}

/// Static parameters of the policy for one pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// Attention layers sharing the pool.
    pub layers: usize,
    /// Pages in the device pool (`P`).
    pub pool_pages: usize,
    /// Resident pages a layer can ever use (pages of the full context); extra goes to the ring.
    pub max_pages_per_layer: usize,
    /// Minimum ring slots (≥ 1: the ring can always stream, in waves).
    pub min_ring_slots: usize,
    /// Under pressure (some layer streams), the ring gets at least this many slots when the pool
    /// allows (streamed layers keep `min_resident_pages`). A ring this deep keeps the copy engine
    /// busy while the layers between two streamed attention layers compute; every extra slot
    /// costs one more streamed page per step. 0 = no floor.
    #[serde(default)]
    pub stream_ring_slots: usize,
    /// Resident pages a streamed layer keeps at least.
    pub min_resident_pages: usize,
    /// The ring should hold this multiple of one streamed layer's deficit (prior art: 1.10).
    pub overlap_target: f64,
    /// Ready-miss rate above which the ring is considered too shallow.
    pub miss_threshold: f64,
    /// Copy-busy fraction above which the copy engine is considered saturated.
    pub copy_saturation: f64,
    /// Consecutive evaluations before growing (a better layout / a deeper ring).
    pub grow_after: u32,
    /// Consecutive evaluations of saturation before shrinking the ring.
    pub shrink_after: u32,
    /// Evaluations between two layout changes under pressure.
    pub cooldown: u32,
    /// Pages of extra traffic tolerated before a better layout is considered.
    pub hysteresis_pages: usize,
}

impl PolicyConfig {
    /// Defaults from the prior art for `layers` layers and a pool of `pool_pages` pages.
    pub fn new(layers: usize, pool_pages: usize, max_pages_per_layer: usize) -> Self {
        Self {
            layers,
            pool_pages,
            max_pages_per_layer,
            min_ring_slots: 1,
            stream_ring_slots: 0,
            min_resident_pages: 1,
            overlap_target: 1.10,
            miss_threshold: 0.01,
            copy_saturation: 0.80,
            grow_after: 3,
            shrink_after: 8,
            cooldown: 64,
            hysteresis_pages: 0,
        }
    }

    /// The smallest pool this configuration accepts: one ring minimum plus every layer's minimum.
    pub fn min_pool_pages(&self) -> usize {
        self.layers * self.min_resident_pages.min(self.max_pages_per_layer)
            + self.min_ring_slots.max(1)
    }
}

/// Measurements since the last decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Feedback {
    /// Ready fences waited on.
    pub ready_waits: u64,
    /// Of those, how many were not complete when the consumer reached them.
    pub ready_misses: u64,
    /// Fraction of the window the copy engine was busy (0..=1).
    pub copy_busy: f64,
    /// Peak fraction of ring slots in use (0..=1).
    pub ring_occupancy: f64,
}

/// One observation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyInput {
    /// Pages each layer must hold after this step (all layers hold the same tokens).
    pub active_pages: usize,
    /// Queries in this step.
    pub query_width: usize,
    /// The phase of this step.
    pub phase: PolicyPhase,
    /// Feedback since the previous decision.
    pub feedback: Feedback,
}

/// A device layout: resident pages per layer and ring slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Resident pages of each attention layer.
    pub resident: Vec<usize>,
    /// Slots of the shared ring.
    pub ring_slots: usize,
}

impl Placement {
    /// Pages of the pool this placement uses (`Σ resident + ring`).
    pub fn total_pages(&self) -> usize {
        self.resident.iter().sum::<usize>() + self.ring_slots
    }
    /// Pages that must stream per step when each layer holds `active_pages`.
    pub fn streamed_pages(&self, active_pages: usize) -> usize {
        self.resident
            .iter()
            .map(|&r| active_pages.saturating_sub(r))
            .sum()
    }
    /// Layers that stream at `active_pages`.
    pub fn streamed_layers(&self, active_pages: usize) -> usize {
        self.resident.iter().filter(|&&r| r < active_pages).count()
    }
}

/// What the policy remembers between decisions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PolicyState {
    /// The layout in force (None before the first decision).
    pub current: Option<Placement>,
    /// Phase of the last decision.
    pub phase: Option<PolicyPhase>,
    /// Pool size the current layout was made for.
    pub pool_pages: usize,
    /// Overlap factor in force (feedback retunes it); 0 means "use the configured target".
    pub overlap: f64,
    /// Consecutive evaluations in which a better layout existed.
    pub better_streak: u32,
    /// Consecutive decode evaluations with ready misses and an idle copy engine.
    pub miss_streak: u32,
    /// Consecutive decode evaluations with a saturated copy engine.
    pub busy_streak: u32,
    /// Evaluations since the last change.
    pub since_change: u32,
    /// The overlap factor changed and the layout should follow (after the cooldown).
    pub retune: bool,
}

/// The policy's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The proposed layout.
    pub placement: Placement,
    /// True when it differs from the layout in force.
    pub changed: bool,
    /// The state to keep if (and only if) the device accepts the proposal.
    pub state: PolicyState,
}

/// The pool cannot hold the minimum layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool of {pool_pages} pages cannot hold {layers} layers × {min_resident} resident pages + {min_ring} ring slots")]
pub struct PolicyError {
    pub pool_pages: usize,
    pub layers: usize,
    pub min_resident: usize,
    pub min_ring: usize,
}

/// The best layout for `active_pages` pages per layer, ignoring history.
pub fn ideal(
    cfg: &PolicyConfig,
    active_pages: usize,
    overlap: f64,
) -> Result<Placement, PolicyError> {
    let l = cfg.layers;
    let p = cfg.pool_pages;
    let min_ring = cfg.min_ring_slots.max(1);
    let a = active_pages.min(cfg.max_pages_per_layer);
    let min_res = cfg.min_resident_pages.min(cfg.max_pages_per_layer);
    let err = PolicyError {
        pool_pages: p,
        layers: l,
        min_resident: min_res,
        min_ring,
    };
    if p < cfg.min_pool_pages() {
        return Err(err);
    }
    if l == 0 {
        return Ok(Placement {
            resident: Vec::new(),
            ring_slots: p,
        });
    }
    // Everything fits: uniform, maximal residency (headroom), the rest is ring.
    if a.checked_mul(l)
        .and_then(|x| x.checked_add(min_ring))
        .is_some_and(|x| x <= p)
    {
        let cap = ((p - min_ring) / l).min(cfg.max_pages_per_layer);
        return Ok(Placement {
            resident: vec![cap; l],
            ring_slots: p - cap * l,
        });
    }
    // Pressure: the fewest streamed layers S that can work at all.
    for s in 1..=l {
        let full = (l - s).saturating_mul(a);
        if full > p {
            continue;
        }
        let f = p - full;
        if f < s * min_res + min_ring {
            continue;
        }
        let r_hi = a.saturating_sub(1).min((f - min_ring) / s).max(min_res);
        let target = overlap.max(1.0);
        let covers = |r: usize| {
            let ring = f - s * r;
            ring as f64 >= (target * (a - r) as f64).ceil()
        };
        // No quota lets the ring cover a whole layer: the ring takes the share
        // (overlap − 1)/overlap of the streamed layers' space (deeper when feedback raised the
        // overlap factor), the rest stays resident.
        let fallback = || {
            let ring_t = ((f as f64 * (target - 1.0) / target).ceil() as usize).max(min_ring);
            ((f - ring_t.min(f)) / s).clamp(min_res, r_hi)
        };
        let mut r = (min_res..=r_hi)
            .rev()
            .find(|&r| covers(r))
            .unwrap_or_else(fallback);
        // The streaming ring floor: deepen the ring (lowering the streamed layers' quota) up to
        // `stream_ring_slots`, never below `min_res` resident pages per streamed layer.
        let floor = cfg.stream_ring_slots.min(f - s * min_res);
        if f - s * r < floor {
            r = ((f - floor) / s).max(min_res);
        }
        let mut resident = vec![a; l];
        for j in 0..s {
            resident[j * l / s] = r;
        }
        return Ok(Placement {
            resident,
            ring_slots: f - s * r,
        });
    }
    Err(err)
}

/// Decides the layout for one observation. Pure: the caller keeps `Decision::state` only if the
/// device accepts `Decision::placement`.
pub fn decide(
    cfg: &PolicyConfig,
    state: &PolicyState,
    input: &PolicyInput,
) -> Result<Decision, PolicyError> {
    let mut next = state.clone();
    if next.overlap <= 0.0 {
        next.overlap = cfg.overlap_target;
    }
    let a = input.active_pages.min(cfg.max_pages_per_layer);

    // Feedback from one-query decode over immutable history retunes the overlap factor.
    if input.phase == PolicyPhase::Decode && input.feedback.ready_waits > 0 {
        let fb = input.feedback;
        let miss_rate = fb.ready_misses as f64 / fb.ready_waits as f64;
        if miss_rate > cfg.miss_threshold && fb.copy_busy < cfg.copy_saturation {
            next.miss_streak += 1;
        } else {
            next.miss_streak = 0;
        }
        // A saturated copy engine, or a ring that stays mostly empty without misses ("light"),
        // both argue for a shallower ring and more resident pages.
        let light = fb.ring_occupancy < 0.5 && fb.ready_misses == 0;
        if fb.copy_busy > cfg.copy_saturation || light {
            next.busy_streak += 1;
        } else {
            next.busy_streak = 0;
        }
        if next.miss_streak >= cfg.grow_after {
            let o = (next.overlap * 1.25).min(4.0);
            next.retune |= o != next.overlap;
            next.overlap = o;
            next.miss_streak = 0;
        }
        if next.busy_streak >= cfg.shrink_after {
            let o = (next.overlap / 1.25).max(1.0);
            next.retune |= o != next.overlap;
            next.overlap = o;
            next.busy_streak = 0;
        }
    }

    let fresh = next.current.is_none()
        || next.phase != Some(input.phase)
        || next.pool_pages != cfg.pool_pages
        || next.current.as_ref().map(|c| c.resident.len()) != Some(cfg.layers);
    let best = ideal(cfg, a, next.overlap)?;
    next.phase = Some(input.phase);
    next.pool_pages = cfg.pool_pages;

    let adopt = |mut st: PolicyState, placement: Placement, changed: bool| {
        if changed {
            st.since_change = 0;
            st.better_streak = 0;
            st.retune = false;
        } else {
            st.since_change = st.since_change.saturating_add(1);
        }
        st.current = Some(placement.clone());
        Decision {
            placement,
            changed,
            state: st,
        }
    };

    let Some(cur) = next.current.clone().filter(|_| !fresh) else {
        return Ok(adopt(next, best, true));
    };
    let cur_traffic = cur.streamed_pages(a);
    let best_traffic = best.streamed_pages(a);
    if best == cur {
        next.better_streak = 0;
        return Ok(adopt(next, cur, false));
    }
    if cur_traffic == 0 && !next.retune {
        next.better_streak = 0;
        return Ok(adopt(next, cur, false));
    }
    if best_traffic == 0 {
        // Everything fits: no ring traffic, right away.
        return Ok(adopt(next, best, true));
    }
    if cur_traffic > best_traffic + cfg.hysteresis_pages {
        next.better_streak += 1;
    } else {
        next.better_streak = 0;
    }
    let cooled = next.since_change >= cfg.cooldown;
    let wide = input.phase != PolicyPhase::Decode;
    let better = cur_traffic > best_traffic + cfg.hysteresis_pages;
    if (wide && better) || (cooled && (next.better_streak >= cfg.grow_after || next.retune)) {
        return Ok(adopt(next, best, true));
    }
    Ok(adopt(next, cur, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(layers: usize, pool: usize, max: usize) -> PolicyConfig {
        PolicyConfig::new(layers, pool, max)
    }

    fn input(pages: usize, phase: PolicyPhase) -> PolicyInput {
        PolicyInput {
            active_pages: pages,
            query_width: 1,
            phase,
            feedback: Feedback::default(),
        }
    }

    #[test]
    fn worked_example_concentrates_streaming() {
        // 16 layers, 100 pages, 10 active pages each: 160 needed, deficit 60.
        let c = cfg(16, 100, 1024);
        let p = ideal(&c, 10, 1.1).expect("fits the minimum");
        assert_eq!(p.total_pages(), 100);
        let s = p.streamed_layers(10);
        // S−1 streamed layers cannot work: the fully resident rest would leave too little.
        let full = (16 - (s - 1)) * 10;
        assert!(
            full > 100 || 100 - full < (s - 1) + 1,
            "S = {s} is not minimal"
        );
        assert!(s < 16, "streaming should not be spread over every layer");
    }

    #[test]
    fn streaming_ring_floor_deepens_the_ring_but_keeps_the_minimum_resident() {
        // 16 layers of 1024 active pages in a 5,500-page pool (the 27B / 256 Ki / 2,240 MiB
        // shape): without a floor the ring is shallow; with it, the ring reaches the floor and
        // the streamed layers give up resident pages, the fully resident ones keep theirs.
        let mut c = cfg(16, 5500, 1024);
        let shallow = ideal(&c, 1024, 1.1).expect("fits");
        c.stream_ring_slots = 315;
        let deep = ideal(&c, 1024, 1.1).expect("fits");
        assert!(shallow.ring_slots < 315, "{shallow:?}");
        assert!(deep.ring_slots >= 315, "{deep:?}");
        assert_eq!(deep.resident.iter().sum::<usize>() + deep.ring_slots, 5500);
        let full = |p: &Placement| p.resident.iter().filter(|&&r| r == 1024).count();
        assert_eq!(
            full(&deep),
            full(&shallow),
            "same layers stay fully resident"
        );
        assert!(deep.resident.iter().all(|&r| r >= c.min_resident_pages));
        // A floor the pool cannot pay is clamped: streamed layers keep their minimum.
        c.stream_ring_slots = 100_000;
        let clamped = ideal(&c, 1024, 1.1).expect("fits");
        assert!(clamped.resident.iter().all(|&r| r >= c.min_resident_pages));
        assert_eq!(
            clamped.resident.iter().sum::<usize>() + clamped.ring_slots,
            5500
        );
        // Without pressure the floor changes nothing.
        let fits = ideal(&c, 100, 1.1).expect("fits");
        assert_eq!(fits, ideal(&cfg(16, 5500, 1024), 100, 1.1).expect("fits"));
    }

    #[test]
    fn too_small_pool_is_an_error() {
        let c = cfg(4, 4, 100);
        assert!(ideal(&c, 10, 1.1).is_err());
        assert!(decide(&c, &PolicyState::default(), &input(10, PolicyPhase::Decode)).is_err());
    }

    #[test]
    fn fits_then_pressure_then_fits_again() {
        let c = cfg(4, 41, 64);
        let st = PolicyState::default();
        let d = decide(&c, &st, &input(3, PolicyPhase::Decode)).expect("ok");
        assert!(d.changed);
        assert_eq!(d.placement.streamed_pages(3), 0);
        assert_eq!(d.placement.resident, vec![10; 4]);
        let d2 = decide(&c, &d.state, &input(12, PolicyPhase::Decode)).expect("ok");
        // Layout stays (cooldown) but the pool still balances.
        assert_eq!(d2.placement.total_pages(), 41);
        // A phase change re-plans at once and concentrates.
        let d3 = decide(&c, &d2.state, &input(12, PolicyPhase::Prefill)).expect("ok");
        assert!(d3.changed);
        assert!(d3.placement.streamed_layers(12) < 4);
    }

    #[test]
    fn feedback_misses_grow_the_ring_after_streaks() {
        let mut c = cfg(2, 30, 64);
        c.cooldown = 0;
        let mut st = PolicyState::default();
        let mut inp = input(20, PolicyPhase::Decode);
        let first = decide(&c, &st, &inp).expect("ok");
        st = first.state;
        inp.feedback = Feedback {
            ready_waits: 10,
            ready_misses: 5,
            copy_busy: 0.2,
            ring_occupancy: 1.0,
        };
        let mut rings = vec![first.placement.ring_slots];
        for _ in 0..(3 * c.grow_after) {
            let d = decide(&c, &st, &inp).expect("ok");
            st = d.state;
            rings.push(d.placement.ring_slots);
        }
        assert!(
            rings.last() > rings.first(),
            "misses with an idle copy engine should deepen the ring: {rings:?}"
        );
    }

    proptest! {
        #[test]
        fn invariant_fits_and_concentration(
            layers in 1usize..20,
            pool_extra in 0usize..400,
            pages in 0usize..200,
            min_ring in 1usize..6,
            max_pages in 1usize..300,
        ) {
            let mut c = cfg(layers, 0, max_pages);
            c.min_ring_slots = min_ring;
            c.pool_pages = c.min_pool_pages() + pool_extra;
            let d = decide(&c, &PolicyState::default(), &input(pages, PolicyPhase::Decode)).expect("pool >= minimum");
            let p = &d.placement;
            prop_assert_eq!(p.total_pages(), c.pool_pages);
            prop_assert!(p.ring_slots >= min_ring);
            prop_assert_eq!(p.resident.len(), layers);
            let a = pages.min(max_pages);
            if a * layers + min_ring <= c.pool_pages {
                prop_assert_eq!(p.streamed_pages(a), 0);
            } else {
                let s = p.streamed_layers(a);
                prop_assert!(s >= 1);
                // With one streamed layer fewer, the fully resident layers would not leave room.
                if s > 1 {
                    let full = (layers - (s - 1)) * a;
                    let minr = c.min_resident_pages.min(max_pages);
                    prop_assert!(full > c.pool_pages || c.pool_pages - full < (s - 1) * minr + min_ring);
                }
                for &r in &p.resident {
                    prop_assert!(r == a || r >= c.min_resident_pages.min(max_pages));
                }
            }
        }

        #[test]
        fn hysteresis_is_stable(
            layers in 1usize..8,
            pool_extra in 0usize..60,
            pages in 1usize..40,
            wiggle in proptest::collection::vec(0usize..2, 1..40),
        ) {
            let c = cfg(layers, 0, 64);
            let mut c = c;
            c.pool_pages = c.min_pool_pages() + pool_extra;
            let mut st = decide(&c, &PolicyState::default(), &input(pages, PolicyPhase::Decode)).expect("ok").state;
            // Repeating the same observation never changes the layout.
            let again = decide(&c, &st, &input(pages, PolicyPhase::Decode)).expect("ok");
            prop_assert!(!again.changed);
            // Wiggling by one page changes it at most once per cooldown window.
            let mut changes = 0usize;
            for (i, w) in wiggle.iter().enumerate() {
                let d = decide(&c, &st, &input(pages + w, PolicyPhase::Decode)).expect("ok");
                prop_assert_eq!(d.placement.total_pages(), c.pool_pages);
                if d.changed { changes += 1; }
                st = d.state;
                prop_assert!(changes <= 1 + i / (c.cooldown as usize).max(1), "oscillates: {} changes in {} steps", changes, i + 1);
            }
        }
    }
}
