//! kvstream-model-qwen (under construction).
