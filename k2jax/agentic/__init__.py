"""Agentic tool use: tool registry (MCP / OpenAI forms), call parsing and validation, action guards,
and multi-turn token-in/token-out rollouts against environments."""

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
from k2jax.agentic.rollout import MultiTurnConfig, MultiTurnRunner, Trajectory, Turn, to_rollout_batch
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
  "MultiTurnConfig",
  "MultiTurnRunner",
  "Trajectory",
  "Turn",
  "to_rollout_batch",
]
