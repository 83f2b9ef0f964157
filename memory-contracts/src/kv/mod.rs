//! KV cache formats, page geometry and span plans.
pub mod format;
pub mod geometry;
pub mod span;
