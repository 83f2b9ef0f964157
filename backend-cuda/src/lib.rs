//! kvstream-backend-cuda (under construction).
