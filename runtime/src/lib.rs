//! kvstream-runtime (under construction).
