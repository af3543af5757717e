"""gem_jax: a GEM-style ads foundation model and its training system in JAX/Flax NNX."""

__version__ = "0.1.0"
