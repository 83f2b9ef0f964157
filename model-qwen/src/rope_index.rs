//! Multimodal M-RoPE positions (HF `Qwen3_5Model.get_rope_index`, qwen-spec §6).
//!
//! Walk the tokens with a counter `cur`: a text token gets `[cur; 3]` and `cur += 1`; a run of
//! `<|image_pad|>` tokens for an image whose LLM grid is (t, h', w') = (t, h/merge, w/merge) gets
//! `[cur + ti, cur + row, cur + col]` in (t, row, col) order, then `cur += max(h', w')`.
//! Later tokens (decode) continue at `next_position` on all three axes.

use crate::vision::VisionConfig;
use kvstream_memory_contracts::ops::Position3;

/// Why positions could not be assigned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RopeIndexError {
    /// More `<|image_pad|>` runs than image grids.
    #[error("image token at index {index} but only {grids} image grid(s) were given")]
    MissingGrid { index: usize, grids: usize },
    /// An image's placeholder run is shorter than its grid needs.
    #[error(
        "image {image} needs {needed} consecutive image tokens from index {start}, found {found}"
    )]
    ShortRun {
        image: usize,
        start: usize,
        needed: usize,
        found: usize,
    },
    /// Grids left over after the last image run.
    #[error("{unused} image grid(s) have no image tokens")]
    UnusedGrids { unused: usize },
    /// A grid that is empty or not divisible by the merge size.
    #[error("image {image}: grid {grid:?} is empty or not divisible by the merge size {merge}")]
    BadGrid {
        image: usize,
        grid: [usize; 3],
        merge: usize,
    },
    /// Video placeholders are not supported here.
    #[error("video token at index {index}: video input is not supported")]
    Video { index: usize },
    /// A position does not fit u32.
    #[error("positions overflow u32")]
    Overflow,
}

/// Positions of a prompt, and where the text after it continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    /// One (t, h, w) position per token.
    pub positions: Vec<Position3>,
    /// The position of the next token (max position + 1; `start` when no tokens).
    pub next_position: u32,
    /// HF's `rope_deltas`: `next_position − (start + tokens.len())` (≤ 0 with images).
    pub rope_delta: i64,
}

/// Assigns M-RoPE positions to `tokens` (starting at position `start`), consuming one
/// `image_grids` entry (t, h, w in patches, as the processor reports it) per image placeholder
/// run of `t·h·w / merge²` `<|image_pad|>` tokens, in order. Equals HF `get_rope_index` for
/// every prompt where images are separated by other tokens (as `<|vision_start|>`/`<|vision_end|>`
/// always do); back-to-back placeholder runs are split by grid size here.
pub fn mrope_positions(
    tokens: &[u32],
    image_grids: &[[usize; 3]],
    config: &VisionConfig,
    start: u32,
) -> Result<MropePositions, RopeIndexError> {
    let m = config.spatial_merge_size;
    let mut cur = u64::from(start);
    let mut max_pos: Option<u64> = None;
    let mut positions: Vec<Position3> = Vec::with_capacity(tokens.len());
    let mut next_grid = 0usize;
    let fit = |v: u64| u32::try_from(v).map_err(|_| RopeIndexError::Overflow);
    let mut i = 0usize;
    while i < tokens.len() {
        let tok = tokens[i];
        if tok == config.video_token_id {
            return Err(RopeIndexError::Video { index: i });
        }
        if tok != config.image_token_id {
            let p = fit(cur)?;
            positions.push([p; 3]);
            max_pos = Some(cur);
            cur += 1;
            i += 1;
            continue;
        }
        let image = next_grid;
        let grid = *image_grids.get(image).ok_or(RopeIndexError::MissingGrid {
            index: i,
            grids: image_grids.len(),
        })?;
        next_grid += 1;
        let [t, gh, gw] = grid;
        if t == 0 || gh == 0 || gw == 0 || gh % m != 0 || gw % m != 0 {
            return Err(RopeIndexError::BadGrid {
                image,
                grid,
                merge: m,
            });
        }
        let (lh, lw) = (gh / m, gw / m);
        let needed = t * lh * lw;
        let found = tokens[i..]
            .iter()
            .take(needed)
            .take_while(|&&x| x == config.image_token_id)
            .count();
        if found < needed {
            return Err(RopeIndexError::ShortRun {
                image,
                start: i,
                needed,
                found,
            });
        }
        for ti in 0..t {
            for r in 0..lh {
                for c in 0..lw {
                    let p = [cur + ti as u64, cur + r as u64, cur + c as u64];
                    max_pos = Some(max_pos.unwrap_or(0).max(p[0]).max(p[1]).max(p[2]));
                    positions.push([fit(p[0])?, fit(p[1])?, fit(p[2])?]);
                }
            }
        }
        cur += lh.max(lw) as u64;
        i += needed;
    }
    if next_grid != image_grids.len() {
        return Err(RopeIndexError::UnusedGrids {
            unused: image_grids.len() - next_grid,
        });
    }
    let next = max_pos.map_or(u64::from(start), |p| p + 1);
    Ok(MropePositions {
        positions,
        next_position: fit(next)?,
        rope_delta: next as i64 - (i64::from(start) + tokens.len() as i64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VisionConfig {
        let v = serde_json::json!({"vision_config": {}, "image_token_id": 9, "video_token_id": 8});
        VisionConfig::from_json_value(&v, std::path::Path::new("/c.json")).expect("cfg")
    }

    #[test]
    fn text_only_is_plain_positions_and_image_advances_by_max_side() {
        let c = cfg();
        let r = mrope_positions(&[1, 2, 3], &[], &c, 5).expect("ok");
        assert_eq!(r.positions, vec![[5; 3], [6; 3], [7; 3]]);
        assert_eq!((r.next_position, r.rope_delta), (8, 0));
        // 1 text, a 2×3 llm grid (patch grid 4×6), 1 text.
        let toks = [1, 9, 9, 9, 9, 9, 9, 2];
        let r = mrope_positions(&toks, &[[1, 4, 6]], &c, 0).expect("ok");
        assert_eq!(r.positions[1], [1, 1, 1]);
        assert_eq!(r.positions[3], [1, 1, 3]);
        assert_eq!(r.positions[4], [1, 2, 1]);
        assert_eq!(r.positions[7], [4; 3]);
        assert_eq!((r.next_position, r.rope_delta), (5, 5 - 8));
    }

    #[test]
    fn inconsistent_inputs_are_typed_errors() {
        let c = cfg();
        assert!(matches!(
            mrope_positions(&[9, 9], &[], &c, 0),
            Err(RopeIndexError::MissingGrid { index: 0, .. })
        ));
        assert!(matches!(
            mrope_positions(&[9, 9, 1], &[[1, 4, 4]], &c, 0),
            Err(RopeIndexError::ShortRun {
                needed: 4,
                found: 2,
                ..
            })
        ));
        assert!(matches!(
            mrope_positions(&[1], &[[1, 2, 2]], &c, 0),
            Err(RopeIndexError::UnusedGrids { unused: 1 })
        ));
        assert!(matches!(
            mrope_positions(&[9], &[[1, 3, 2]], &c, 0),
            Err(RopeIndexError::BadGrid { .. })
        ));
        assert!(matches!(
            mrope_positions(&[1, 8], &[], &c, 0),
            Err(RopeIndexError::Video { index: 1 })
        ));
    }
}
