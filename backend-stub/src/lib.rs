//! kvstream-backend-stub (under construction).
