//! The decode roofline: the fastest a step can be given the measured ceilings.
//!
//! A decode step must read every weight once from device memory and copy every streamed KV
//! byte over the host link, so `min step = weight bytes / HBM GB/s + streamed KV bytes /
//! H2D GB/s` (the two are not assumed to overlap; this is the definition).

use serde::{Deserialize, Serialize};

/// Measured bandwidth ceilings (GB/s, 1 GB = 1e9 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Pinned host → device copy bandwidth.
    pub h2d_gbps: f64,
    /// Device memory read bandwidth (a weight-streaming GEMV).
    pub hbm_gbps: f64,
}

/// Minimum step seconds for `weight_bytes` read from device memory and `streamed_bytes` copied
/// host → device. `None` if a ceiling is not positive.
pub fn min_step_seconds(c: &Ceilings, weight_bytes: f64, streamed_bytes: f64) -> Option<f64> {
    if c.h2d_gbps <= 0.0 || c.hbm_gbps <= 0.0 || !c.h2d_gbps.is_finite() {
        return None;
    }
    Some(weight_bytes / (c.hbm_gbps * 1e9) + streamed_bytes / (c.h2d_gbps * 1e9))
}

/// Expected tokens emitted per verification with `n` drafts, each accepted with probability
/// `a` given its predecessors were: `Σ_{i=0..=n} aⁱ` (the bonus/correction token included).
pub fn expected_tokens_per_step(n: usize, a: f64) -> f64 {
    (0..=n).map(|i| a.powi(i as i32)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_adds_weight_and_stream_terms() {
        let c = Ceilings {
            h2d_gbps: 50.0,
            hbm_gbps: 4000.0,
        };
        let w = 54e9;
        let kv = 2.5e9;
        let t = min_step_seconds(&c, w, kv).expect("positive");
        assert!((t - (w / 4000e9 + kv / 50e9)).abs() < 1e-12);
        assert!((t - 0.0635).abs() < 1e-9, "{t}");
        let none = min_step_seconds(&c, w, 0.0).expect("positive");
        assert!(none < t);
        assert!(min_step_seconds(&Ceilings { h2d_gbps: 0.0, ..c }, w, kv).is_none());
    }

    #[test]
    fn expected_tokens_follow_the_geometric_series() {
        assert!((expected_tokens_per_step(0, 0.7) - 1.0).abs() < 1e-12);
        assert!((expected_tokens_per_step(3, 0.5) - 1.875).abs() < 1e-12);
        let a = 0.8f64;
        let closed = (1.0 - a.powi(4)) / (1.0 - a);
        assert!((expected_tokens_per_step(3, a) - closed).abs() < 1e-12);
    }
}
