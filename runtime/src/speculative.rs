//! Speculative decoding with the model's MTP (NextN) head: the acceptance rules.
//!
//! The target verifies `[last, d_1, …, d_k]` in one pass and yields, for each position j, its
//! next-token distribution `p_j` (or argmax `y_j` when greedy). Acceptance walks the drafts in
//! order:
//! * **greedy**: accept `d_{j+1}` while it equals `y_j`; the first mismatch (or the end) emits the
//!   target's own token `y_a`. The output equals greedy decoding without speculation.
//! * **sampling**: accept `d_{j+1}` with probability `min(1, p_j(d)/q_j(d))` (q = the draft's
//!   distribution); on rejection sample from `norm(max(0, p_j − q_j))`; if all drafts pass, sample
//!   the bonus token from `p_k`. The output distribution equals sampling from the target alone
//!   (Leviathan et al. / Chen et al.).

use crate::error::{Result, RuntimeError};
use crate::sampling::{Distribution, SamplingParams};
use rand::Rng;
use serde::{Deserialize, Serialize};

/// Largest number of drafts per verification (`--spec-draft-n-max`).
pub const MAX_DRAFT_N: usize = 4;

/// Speculative decoding with the MTP head (`--spec-type draft-mtp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecConfig {
    /// Drafts per verification, `1..=4`; the target verifies up to `draft_n_max + 1` tokens.
    pub draft_n_max: usize,
}

impl SpecConfig {
    /// Fails with [`RuntimeError::InvalidConfig`] unless `1 <= draft_n_max <= 4`.
    pub fn validate(&self) -> Result<()> {
        if (1..=MAX_DRAFT_N).contains(&self.draft_n_max) {
            Ok(())
        } else {
            Err(RuntimeError::InvalidConfig(format!(
                "spec draft_n_max must be in 1..={MAX_DRAFT_N}, got {}",
                self.draft_n_max
            )))
        }
    }
}

/// What speculative decoding reports in [`crate::EngineStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecReport {
    /// Drafts per verification at most.
    pub draft_n_max: usize,
    /// Verification passes that carried at least one draft.
    pub verifications: u64,
    /// Tokens drafted by the MTP head.
    pub drafted: u64,
    /// Drafts the target accepted.
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Mean drafts accepted per verification.
    pub mean_accepted_per_verification: f64,
    /// Device bytes of the MTP head's weights.
    pub mtp_weight_bytes: u64,
    /// Resident KV pages of the MTP layer in the shared pool (current layout).
    pub mtp_resident_pages: usize,
    /// Peak device bytes of the recurrent-state checkpoint stage (one GDN state per verified
    /// position plus the step's restore copy).
    pub checkpoint_stage_bytes: u64,
}

impl SpecReport {
    /// The report of `stats` with the given memory figures.
    pub fn new(
        draft_n_max: usize,
        stats: &SpecStats,
        mtp_weight_bytes: u64,
        mtp_resident_pages: usize,
        checkpoint_stage_bytes: u64,
    ) -> Self {
        Self {
            draft_n_max,
            verifications: stats.verifications,
            drafted: stats.drafted,
            accepted: stats.accepted,
            acceptance_rate: stats.acceptance_rate(),
            mean_accepted_per_verification: stats.mean_accepted(),
            mtp_weight_bytes,
            mtp_resident_pages,
            checkpoint_stage_bytes,
        }
    }
}

/// The full-vocabulary distribution [`crate::Sampler::sample`] draws from for `logits` (repeat,
/// presence and frequency penalties, temperature, top-k, top-p, min-p, renormalised), as `f32`
/// probabilities (kept in step with the sampler by `probs_match_the_sampler`). With
/// temperature 0 it is the one-hot of the greedy token.
pub fn probs(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; logits.len()];
    match crate::sampling::distribution(p, logits, history)? {
        Distribution::Greedy(t) => out[t as usize] = 1.0,
        Distribution::Candidates { cand, probs, keep } => {
            let total: f64 = probs[..keep].iter().sum();
            for ((t, _), pr) in cand[..keep].iter().zip(&probs) {
                out[*t as usize] = (pr / total) as f32;
            }
        }
    }
    Ok(out)
}

/// What a verification decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix of the drafts).
    pub accepted: usize,
    /// The token emitted after the accepted drafts (the target's correction or bonus token).
    pub next: u32,
}

/// Greedy acceptance: `target_argmax[j]` is the target's token after position j (k + 1 entries
/// for k drafts).
pub fn accept_greedy(drafts: &[u32], target_argmax: &[u32]) -> Option<Verdict> {
    if target_argmax.len() != drafts.len() + 1 {
        return None;
    }
    let accepted = drafts
        .iter()
        .zip(target_argmax)
        .take_while(|(d, y)| d == y)
        .count();
    Some(Verdict {
        accepted,
        next: target_argmax[accepted],
    })
}

/// Draws an index with probability proportional to `probs` (argmax when all are zero).
pub fn sample_from<R: Rng>(probs: &[f32], rng: &mut R) -> u32 {
    let total: f64 = probs.iter().map(|&p| f64::from(p.max(0.0))).sum();
    if total <= 0.0 {
        return crate::sampling::argmax(probs).unwrap_or(0) as u32;
    }
    let mut u = rng.random::<f64>() * total;
    let mut last_positive = 0usize;
    for (i, &p) in probs.iter().enumerate() {
        let p = f64::from(p.max(0.0));
        if p > 0.0 {
            last_positive = i;
            if u < p {
                return i as u32;
            }
            u -= p;
        }
    }
    last_positive as u32
}

/// Speculative sampling. `draft_probs[j]` is q over the vocabulary at draft j (k entries),
/// `target_probs[j]` is p at position j (k + 1 entries). Both must already include the same
/// temperature / top-k / top-p / min-p transforms.
pub fn accept_sampled<R: Rng>(
    drafts: &[u32],
    draft_probs: &[Vec<f32>],
    target_probs: &[Vec<f32>],
    rng: &mut R,
) -> Option<Verdict> {
    if draft_probs.len() != drafts.len() || target_probs.len() != drafts.len() + 1 {
        return None;
    }
    for (j, &d) in drafts.iter().enumerate() {
        let p = &target_probs[j];
        let q = &draft_probs[j];
        let (pd, qd) = (*p.get(d as usize)?, *q.get(d as usize)?);
        let ratio = if qd > 0.0 { (pd / qd).min(1.0) } else { 0.0 };
        if rng.random::<f32>() < ratio {
            continue;
        }
        let residual: Vec<f32> = p
            .iter()
            .zip(q.iter())
            .map(|(a, b)| (a - b).max(0.0))
            .collect();
        let next = if residual.iter().any(|&r| r > 0.0) {
            sample_from(&residual, rng)
        } else {
            sample_from(p, rng)
        };
        return Some(Verdict { accepted: j, next });
    }
    Some(Verdict {
        accepted: drafts.len(),
        next: sample_from(&target_probs[drafts.len()], rng),
    })
}

/// Counters of speculative decoding, reported in the stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpecStats {
    /// Verification passes run.
    pub verifications: u64,
    /// Tokens drafted by the MTP head.
    pub drafted: u64,
    /// Drafted tokens the target accepted.
    pub accepted: u64,
}

impl SpecStats {
    /// Records one verification.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.verifications += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
    }
    /// accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    /// Mean drafts accepted per verification.
    pub fn mean_accepted(&self) -> f64 {
        if self.verifications == 0 {
            0.0
        } else {
            self.accepted as f64 / self.verifications as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn greedy_accepts_the_matching_prefix() {
        assert_eq!(
            accept_greedy(&[5, 6, 7], &[5, 6, 9, 1]),
            Some(Verdict {
                accepted: 2,
                next: 9
            })
        );
        assert_eq!(
            accept_greedy(&[5, 6, 7], &[5, 6, 7, 1]),
            Some(Verdict {
                accepted: 3,
                next: 1
            })
        );
        assert_eq!(
            accept_greedy(&[5, 6, 7], &[4, 6, 7, 1]),
            Some(Verdict {
                accepted: 0,
                next: 4
            })
        );
        assert_eq!(accept_greedy(&[5], &[5]), None);
    }

    fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> f64 {
        counts
            .iter()
            .zip(probs)
            .filter(|(_, &p)| p > 0.0)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The first emitted token of speculative sampling is distributed as the target's p, for a
    /// draft q that differs from p (chi-square, fixed seed, 5 categories → 4 dof; the 99.9%
    /// critical value is 18.47).
    #[test]
    fn speculative_sampling_preserves_the_target_distribution() {
        let p = vec![0.5f32, 0.2, 0.15, 0.1, 0.05];
        let q = vec![0.1f32, 0.1, 0.5, 0.2, 0.1];
        let p2 = vec![0.2f32; 5];
        let mut rng = StdRng::seed_from_u64(42);
        let n = 200_000u64;
        let mut counts = [0u64; 5];
        for _ in 0..n {
            let d = sample_from(&q, &mut rng);
            let v = accept_sampled(
                &[d],
                std::slice::from_ref(&q),
                &[p.clone(), p2.clone()],
                &mut rng,
            )
            .expect("shapes");
            let first = if v.accepted == 1 { d } else { v.next };
            counts[first as usize] += 1;
        }
        let probs: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        let chi = chi_square(&counts, &probs, n);
        assert!(chi < 18.47, "chi-square {chi} too large: {counts:?}");
        // And a biased sampler (always accepting the draft) is detected by the same test.
        let mut biased = [0u64; 5];
        for _ in 0..n {
            biased[sample_from(&q, &mut rng) as usize] += 1;
        }
        assert!(chi_square(&biased, &probs, n) > 1000.0);
    }

    /// `probs` is the distribution `Sampler::sample` draws from, with every transform on
    /// (chi-square over the kept candidates), and the one-hot greedy token at temperature 0.
    #[test]
    fn probs_match_the_sampler() {
        let mut rng = StdRng::seed_from_u64(3);
        let logits: Vec<f32> = (0..40).map(|_| rng.random::<f32>() * 4.0 - 2.0).collect();
        let history: Vec<u32> = (0..30).map(|_| rng.random_range(0..40u32)).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.02,
            seed: 9,
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            presence_penalty: 0.2,
            frequency_penalty: 0.1,
        };
        let p = probs(&params, &logits, &history).expect("probs");
        assert!((p.iter().map(|&x| f64::from(x)).sum::<f64>() - 1.0).abs() < 1e-5);
        let mut s = crate::Sampler::new(params).expect("sampler");
        let n = 100_000u64;
        let mut counts = vec![0u64; logits.len()];
        for _ in 0..n {
            counts[s.sample(&logits, &history).expect("sample") as usize] += 1;
        }
        assert!(
            counts.iter().zip(&p).all(|(&c, &x)| x > 0.0 || c == 0),
            "{counts:?} {p:?}"
        );
        let kept = p.iter().filter(|&&x| x > 0.0).count();
        assert!(kept > 3, "too few candidates: {kept}");
        let pf: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        let chi = chi_square(&counts, &pf, n);
        // dof = kept - 1 <= 19; the 99.9% critical value of 19 dof is 43.8.
        assert!(
            chi < 43.8,
            "chi-square {chi}: probs and the sampler disagree"
        );
        let greedy = SamplingParams {
            temperature: 0.0,
            ..params
        };
        let g = probs(&greedy, &logits, &history).expect("probs");
        let t = crate::Sampler::new(greedy)
            .expect("sampler")
            .sample(&logits, &history)
            .expect("sample");
        assert_eq!(g[t as usize], 1.0);
        assert_eq!(g.iter().filter(|&&x| x > 0.0).count(), 1);
    }

    #[test]
    fn stats_report_rates() {
        let mut s = SpecStats::default();
        s.record(3, 2);
        s.record(3, 3);
        assert!((s.acceptance_rate() - 5.0 / 6.0).abs() < 1e-12);
        assert!((s.mean_accepted() - 2.5).abs() < 1e-12);
    }
}
