"""MuonClip optimizer: Muon + AdamW by parameter path, QK-Clip with the MLA split, WSD schedules."""

from k2jax.optim.build import MuonClipState, muonclip, muonclip_metrics
from k2jax.optim.labels import describe_param_groups, label_params, path_name
from k2jax.optim.muon import OwnerSharding, newton_schulz, scale_by_muon
from k2jax.optim.qk_clip import QKClipSpec, clip_updates, clipped_heads, qk_clip
from k2jax.optim.schedules import k2_schedule, wsd_schedule

__all__ = [
  "MuonClipState",
  "muonclip",
  "muonclip_metrics",
  "describe_param_groups",
  "label_params",
  "path_name",
  "OwnerSharding",
  "newton_schulz",
  "scale_by_muon",
  "QKClipSpec",
  "clip_updates",
  "clipped_heads",
  "qk_clip",
  "k2_schedule",
  "wsd_schedule",
]
