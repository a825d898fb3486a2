"""K2 agentic data synthesis: tool repository, agents, rubric tasks, simulated trajectories, judge -> SFT."""

from k2jax.data.synth.llm import LLM, InvalidOutput, extract_json
from k2jax.data.synth.pipeline import STAGES, SynthConfig, from_config_dict, run_synth
from k2jax.data.synth.store import StageStore

__all__ = [
  "LLM",
  "InvalidOutput",
  "extract_json",
  "STAGES",
  "SynthConfig",
  "run_synth",
  "StageStore",
  "from_config_dict",
]
