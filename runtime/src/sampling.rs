//! Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty, with a
//! seeded generator so a (seed, logits) sequence always gives the same tokens.

use crate::error::{Result, RuntimeError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Sampling parameters (llama.cpp vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; `1.0` disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p × p(best)`; `0` disables.
    pub min_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Penalty for tokens among the last `repeat_last_n` (llama.cpp/HF style: positive logits
    /// are divided by it, negative ones multiplied); `1.0` disables.
    pub repeat_penalty: f32,
    /// How many previous tokens the repeat, presence and frequency penalties look at.
    pub repeat_last_n: usize,
    /// OpenAI presence penalty: subtracted once from the logit of every token seen in the
    /// window; `0` disables.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per occurrence in the
    /// window; `0` disables.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    /// Greedy, no penalty, seed 0.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges; every value out of range is an [`RuntimeError::InvalidRequest`].
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(RuntimeError::InvalidRequest(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad(format!(
                "repeat_penalty must be > 0, got {}",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// A seeded sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value (lowest index on ties; NaN is skipped). None if there is none.
pub fn argmax(values: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i)
}

impl Sampler {
    /// A sampler with a generator seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            params,
            rng: StdRng::seed_from_u64(params.seed),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        match distribution(&self.params, logits, history)? {
            Distribution::Greedy(t) => Ok(t),
            Distribution::Candidates { cand, probs, keep } => {
                let total: f64 = probs[..keep].iter().sum();
                let mut u = self.rng.random::<f64>() * total;
                for i in 0..keep {
                    u -= probs[i];
                    if u <= 0.0 {
                        return Ok(cand[i].0);
                    }
                }
                Ok(cand[keep - 1].0)
            }
        }
    }
}

/// What [`Sampler::sample`] draws from, after the repeat, presence and frequency penalties,
/// temperature, top-k, top-p and min-p.
#[derive(Debug, Clone, PartialEq)]
pub enum Distribution {
    /// Temperature 0: the argmax (lowest id on ties).
    Greedy(u32),
    /// Candidates sorted by logit (descending, lower id first on ties) with their softmax
    /// probabilities; only the first `keep` survive top-p / min-p (not renormalised).
    Candidates {
        cand: Vec<(u32, f32)>,
        probs: Vec<f64>,
        keep: usize,
    },
}

fn apply_penalties(p: &SamplingParams, l: &mut [f32], history: &[u32]) {
    let from = history.len().saturating_sub(p.repeat_last_n);
    if p.repeat_penalty != 1.0 {
        let mut seen = std::collections::BTreeSet::new();
        for &t in &history[from..] {
            if let Some(x) = l.get_mut(t as usize) {
                if seen.insert(t) {
                    *x = if *x > 0.0 {
                        *x / p.repeat_penalty
                    } else {
                        *x * p.repeat_penalty
                    };
                }
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts = std::collections::BTreeMap::<u32, u32>::new();
        for &t in &history[from..] {
            *counts.entry(t).or_insert(0) += 1;
        }
        for (t, c) in counts {
            if let Some(x) = l.get_mut(t as usize) {
                *x -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
}

/// The sampling distribution of one row of logits (shared by the sampler and speculative
/// decoding, so both always apply the same transforms).
pub fn distribution(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Result<Distribution> {
    if logits.is_empty() {
        return Err(RuntimeError::InvalidRequest("empty logits row".into()));
    }
    let mut l = logits.to_vec();
    apply_penalties(p, &mut l, history);
    if p.temperature == 0.0 {
        return argmax(&l)
            .map(|i| Distribution::Greedy(i as u32))
            .ok_or_else(|| RuntimeError::InvalidRequest("no finite logits".into()));
    }
    let mut cand: Vec<(u32, f32)> = l
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, v))
        .collect();
    if cand.is_empty() {
        return Err(RuntimeError::InvalidRequest("no finite logits".into()));
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k.max(1));
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand
        .iter()
        .map(|(_, v)| (f64::from(*v - max) / f64::from(p.temperature)).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, x) in probs.iter().enumerate() {
            acc += x;
            if acc >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * f64::from(p.min_p);
        keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
    }
    Ok(Distribution::Candidates { cand, probs, keep })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn random_logits(seed: u64, n: usize) -> Vec<f32> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-4.0f32..4.0)).collect()
    }

    #[test]
    fn presence_and_frequency_penalties_shift_greedy_choice() {
        // Token 0 leads by 1.0; it was seen twice. Presence 0.6 alone keeps it; presence 0.6 +
        // frequency 0.3 (0.6 + 2 * 0.3 = 1.2 > 1.0) hands the choice to token 1.
        let l = [3.0f32, 2.0, -1.0];
        let hist = [0u32, 0, 2];
        let mut p = SamplingParams {
            presence_penalty: 0.6,
            ..SamplingParams::default()
        };
        assert_eq!(
            Sampler::new(p).expect("valid").sample(&l, &hist).ok(),
            Some(0)
        );
        p.frequency_penalty = 0.3;
        assert_eq!(
            Sampler::new(p).expect("valid").sample(&l, &hist).ok(),
            Some(1)
        );
        p.frequency_penalty = 2.5;
        assert!(Sampler::new(p).is_err());
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_on_ties() {
        let l = random_logits(1, 100);
        let mut s = Sampler::new(SamplingParams::default()).expect("valid");
        let best = argmax(&l).expect("nonempty");
        assert!(l.iter().all(|&x| x <= l[best]));
        assert_eq!(s.sample(&l, &[]).ok(), Some(best as u32));
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), Some(1));
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn repeat_penalty_moves_greedy_away_from_history() {
        let mut l = vec![0.0f32; 10];
        l[3] = 2.0;
        l[7] = 1.5;
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(p).expect("valid");
        assert_eq!(s.sample(&l, &[3]).ok(), Some(7));
        assert_eq!(s.sample(&l, &[1]).ok(), Some(3));
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let l = random_logits(2, 200);
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            seed: 42,
            ..Default::default()
        };
        let run = |p| {
            let mut s = Sampler::new(p).expect("valid");
            (0..50)
                .map(|_| s.sample(&l, &[]).unwrap_or(u32::MAX))
                .collect::<Vec<_>>()
        };
        let a = run(p);
        assert_eq!(a, run(p));
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|&x, &y| l[y].total_cmp(&l[x]));
        let top: Vec<u32> = idx[..5].iter().map(|&i| i as u32).collect();
        assert!(
            a.iter().all(|t| top.contains(t)),
            "{a:?} outside top-5 {top:?}"
        );
        assert!(a.iter().collect::<std::collections::BTreeSet<_>>().len() > 1);
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // One dominant token: top_p 0.5 and min_p 0.5 both leave only it.
        let mut l = random_logits(3, 50);
        l[17] = 20.0;
        for p in [
            SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                seed: 9,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                min_p: 0.5,
                seed: 9,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(p).expect("valid");
            for _ in 0..20 {
                assert_eq!(s.sample(&l, &[]).ok(), Some(17));
            }
        }
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
    }
}
