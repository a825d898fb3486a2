"""The HTTP adapter over `k2jax.engine`: SGLang's API and OpenAI's, served from one in-process engine."""

from k2jax.serve.server import Server

__all__ = ["Server"]
