"""Flax NNX layers of Kimi Linear, one layer kind a file."""
