"""The vision demo: read a three-digit number drawn in a small picture (a tiny Qwen2-VL)."""
