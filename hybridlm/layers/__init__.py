"""Flax NNX layers of the hybrid model."""
