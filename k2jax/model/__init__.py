"""The Kimi K2 model in Flax NNX."""

from k2jax.model import presets
from k2jax.model.config import ConfigError, K2Config
from k2jax.model.layers import RouterBias
from k2jax.model.transformer import K2Model, ModelOutput

__all__ = ["ConfigError", "K2Config", "K2Model", "ModelOutput", "RouterBias", "presets"]
