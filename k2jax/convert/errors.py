"""The one error type for unreadable or inconsistent checkpoints (HF directories and k2jax workdirs)."""


class CheckpointError(ValueError):
  """A checkpoint directory is incomplete or inconsistent; the message names the file/tensor."""
