//! kvstream-kernels (under construction).
