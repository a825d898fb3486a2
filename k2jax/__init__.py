"""k2jax: the Kimi K2 recipe in JAX."""

from k2jax.api import load, save_hf

__all__ = ["load", "save_hf"]
