"""Agentic tool use: tool registry (MCP / OpenAI forms), call parsing and validation, action guards, the
environments and their services (`envs/`), and the one multi-turn tool loop (`loop.py`) that RL rollouts
(token-in/token-out, `rollout.py`) and synthesis dialogues (`k2jax.synth`) both run."""

from k2jax.agentic.calls import ParsedTurn, ToolCall, ToolError, parse_openai_calls, parse_turn, validate_call
from k2jax.agentic.guards import (
  Guard,
  GuardConfig,
  Net,
  RateLimit,
  RateLimiter,
  ToolFailure,
  deny_all,
  install_egress_hook,
)
from k2jax.agentic.loop import Agent, EpisodeEnd, StopEpisode, run_tool_loop
from k2jax.agentic.rollout import (
  EpisodeRunner,
  MultiTurnConfig,
  MultiTurnRunner,
  TokenAgent,
  Trajectory,
  Turn,
)
from k2jax.agentic.tools import (
  Impact,
  ToolRegistry,
  ToolSpec,
  ToolSpecError,
  load_tool_dicts,
  sanitize_name,
  tool_from_dict,
)

__all__ = [
  "ParsedTurn",
  "ToolCall",
  "ToolError",
  "parse_openai_calls",
  "parse_turn",
  "validate_call",
  "Guard",
  "GuardConfig",
  "Net",
  "RateLimit",
  "RateLimiter",
  "ToolFailure",
  "deny_all",
  "install_egress_hook",
  "Impact",
  "ToolRegistry",
  "ToolSpec",
  "ToolSpecError",
  "load_tool_dicts",
  "sanitize_name",
  "tool_from_dict",
  "Agent",
  "EpisodeEnd",
  "StopEpisode",
  "run_tool_loop",
  "EpisodeRunner",
  "TokenAgent",
  "MultiTurnConfig",
  "MultiTurnRunner",
  "Trajectory",
  "Turn",
]
