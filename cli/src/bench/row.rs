//! One row of the benchmark table.

use super::roofline::{expected_tokens_per_step, min_step_seconds, Ceilings};
use serde::{Deserialize, Serialize};

/// A tokens/s figure computed from a measured verification step time and an ASSUMED acceptance
/// rate (a projection, not a measurement: random weights make acceptance meaningless).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Projection {
    /// Assumed per-draft acceptance rate.
    pub acceptance: f64,
    /// Expected tokens per verification step at that rate.
    pub tokens_per_step: f64,
    /// Projected tokens/s (excluding the draft head's own cost).
    pub tok_per_s: f64,
}

/// Measurements of one (arena, context, draft count) point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    pub backend: String,
    /// Model directory or `synthetic:<geometry>`.
    pub model: String,
    /// K/V cache types, `k/v`.
    pub kv_types: String,
    /// Device weight formats: `q4_g128 (head q8_0)`, `as stored`, ...
    #[serde(default)]
    pub weights: String,
    pub arena_bytes: u64,
    pub max_pool_pages: Option<usize>,
    /// Requested context (history tokens before the measured steps).
    pub context: usize,
    /// History tokens actually present before the measured steps.
    pub history_tokens: usize,
    /// `synthetic` or `prefill`.
    pub fill: String,
    pub spec_draft_n_max: usize,
    /// `ok`, `projection` (MTP rows from measured verify times) or `skipped`.
    pub status: String,
    /// Why a row is skipped or only projected.
    pub note: String,
    /// Prefill throughput (prefill fill only).
    pub prefill_tok_per_s: Option<f64>,
    /// Decode throughput (n = 0 rows; never blended with prefill).
    pub decode_tok_per_s: Option<f64>,
    /// The step the row is about: a decode step (n = 0) or a verify step of width n + 1, ms.
    pub step_ms: Option<f64>,
    /// Host time spent issuing a decode step's forward pass (n = 0 rows), ms: close to `step_ms`
    /// on a launch-bound device, well below it on a device-bound one.
    #[serde(default)]
    pub step_issue_ms: Option<f64>,
    /// Step time for query widths 1..=4 (median of the repetitions), ms.
    pub step_ms_by_width: Vec<Option<f64>>,
    /// Host → device bytes per step (of the row's step).
    pub h2d_bytes_per_step: f64,
    /// Achieved host → device GB/s during the row's step.
    pub h2d_gbps: f64,
    /// Resident pages of each attention layer.
    pub resident_pages: Vec<usize>,
    pub ring_slots: usize,
    pub pool_pages: usize,
    /// Weight bytes on the device.
    pub weight_bytes: u64,
    /// Peak arena bytes in use (pool + workspace + scratch).
    pub peak_arena_bytes: u64,
    /// Peak device memory the engine holds: weights + the arena allocation.
    pub peak_device_bytes: u64,
    /// Peak device memory in use as the driver reports it (context, scratch and every other
    /// allocation included), sampled after the fill, each width and the decode steps; `None`
    /// on the CPU backend.
    pub peak_device_measured_bytes: Option<u64>,
    /// Measured acceptance (real speculative runs only).
    pub acceptance: Option<f64>,
    /// Measured accepted tokens per step (real speculative runs only).
    pub accepted_per_step: Option<f64>,
    /// PROJECTIONS at assumed acceptance rates (MTP rows with random weights).
    pub projections: Vec<Projection>,
    /// Ceilings measured in the same run.
    pub ceilings: Option<Ceilings>,
    /// Roofline minimum of the row's step, ms.
    pub roofline_step_ms: Option<f64>,
    /// Measured step time / roofline step time.
    pub measured_over_roofline: Option<f64>,
}

impl BenchRow {
    /// Fills the roofline columns from the step time, the H2D bytes and `ceilings`.
    pub fn apply_roofline(&mut self, ceilings: Ceilings) {
        self.ceilings = Some(ceilings);
        let min = min_step_seconds(&ceilings, self.weight_bytes as f64, self.h2d_bytes_per_step);
        self.roofline_step_ms = min.map(|s| s * 1e3);
        self.measured_over_roofline = match (self.step_ms, self.roofline_step_ms) {
            (Some(m), Some(r)) if r > 0.0 => Some(m / r),
            _ => None,
        };
    }

    /// Fills `projections` for `rates` from the row's (verify) step time.
    pub fn project(&mut self, rates: &[f64]) {
        let Some(ms) = self.step_ms.filter(|m| *m > 0.0) else {
            return;
        };
        self.projections = rates
            .iter()
            .map(|&a| {
                let k = expected_tokens_per_step(self.spec_draft_n_max, a);
                Projection {
                    acceptance: a,
                    tokens_per_step: k,
                    tok_per_s: k / (ms / 1e3),
                }
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_ratio_and_projections_use_the_row_values() {
        let mut r = BenchRow {
            step_ms: Some(20.0),
            weight_bytes: 4_000_000_000,
            h2d_bytes_per_step: 500_000_000.0,
            spec_draft_n_max: 2,
            ..Default::default()
        };
        r.apply_roofline(Ceilings {
            h2d_gbps: 50.0,
            hbm_gbps: 4000.0,
        });
        let roof = r.roofline_step_ms.expect("roofline");
        assert!((roof - 11.0).abs() < 1e-9, "{roof}");
        assert!((r.measured_over_roofline.expect("ratio") - 20.0 / 11.0).abs() < 1e-9);
        r.project(&[0.5]);
        assert_eq!(r.projections.len(), 1);
        assert!((r.projections[0].tokens_per_step - 1.75).abs() < 1e-12);
        assert!((r.projections[0].tok_per_s - 87.5).abs() < 1e-9);
    }
}
