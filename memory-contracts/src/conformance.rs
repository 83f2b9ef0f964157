//! Device-generic conformance suite (filled in by the backend work; see docs/porting.md).
