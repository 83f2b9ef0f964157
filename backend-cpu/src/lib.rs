//! kvstream-backend-cpu (under construction).
