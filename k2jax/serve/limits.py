"""Per-request caps: what one HTTP request may ask of the server, so that no request without a key
(`/generate` and the OpenAI routes are open, as in SGLang) can take the engine or the event loop from
the others.

Every cap is checked before any work that grows with it (tokenizing, rendering a chat, queueing), and a
request over a cap gets 400 naming the field, the cap and its value (a `launch/serve.py` flag of the same
name). The body as a whole is bounded by `HttpLimits.max_body_bytes` (413). Stop strings and stop token
ids are counted per prompt: the engine matches them against every sampled token of that prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from k2jax.engine.base import InvalidRequest


@dataclasses.dataclass(frozen=True)
class RequestCaps:
  # Prompts per request (`/generate` batch, OpenAI prompt list x n). The server interleaves a batch's
  # prompts with other requests' (`k2jax.serve.fair`), so a full batch slows others by a share, not a queue.
  max_batch_size: int = 128
  max_stop_strings: int = 32  # per prompt; each is matched against the decoded tail after every token
  max_stop_bytes: int = 4096  # total UTF-8 bytes of a prompt's stop strings
  max_stop_token_ids: int = 256  # per prompt
  max_tools: int = 128  # tools in one chat request (each is rendered into the prompt)
  # UTF-8 bytes of a request's prompt text (all prompts; chat: message contents and tool declarations),
  # checked before tokenizing on the event loop. 1 MiB is ~250k tokens, more than any prompt that fits.
  max_prompt_bytes: int = 1 << 20
  # Engine slots one request's prompts may hold at once; None: all but max(1, 1/8) of them, so a request
  # arriving behind a full batch (whose prompts start, and end, in lockstep) finds a slot at once.
  max_slots_per_request: int | None = None
  # Engine slots one client's prompts (all its requests) may hold at once; None: as max_slots_per_request.
  # A client is its API key when the server has keys, else its peer address (`k2jax.serve.fair`).
  max_slots_per_client: int | None = None
  # HTTP requests one client may have in flight (queued for their turn or running); 429 beyond.
  max_requests_per_client: int = 1024

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) is not None and getattr(self, f.name) < 1:
        raise ValueError(f"RequestCaps.{f.name} must be >= 1, got {getattr(self, f.name)}")

  def slots_per_request(self, max_slots: int) -> int:
    default = max_slots - max(1, max_slots // 8)
    return max(1, min(max_slots, self.max_slots_per_request or default))

  def slots_per_client(self, max_slots: int) -> int:
    if self.max_slots_per_client is None:
      return self.slots_per_request(max_slots)
    return max(1, min(max_slots, self.max_slots_per_client))

  def batch(self, n: int, field: str) -> None:
    if n > self.max_batch_size:
      raise _over(field, f"{n} prompts", "max_batch_size", self.max_batch_size, "prompts per request")

  def stops(self, stop: Sequence[str], stop_token_ids: Sequence[int], field: str) -> None:
    """`field`: the sampling field's prefix (`sampling_params[3].` or `` for OpenAI bodies)."""
    if len(stop) > self.max_stop_strings:
      raise _over(f"{field}stop", f"{len(stop)} stop strings", "max_stop_strings", self.max_stop_strings, "per prompt")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stop if isinstance(s, str))  # raw or validated
    if size > self.max_stop_bytes:
      raise _over(f"{field}stop", f"stop strings of {size} bytes", "max_stop_bytes", self.max_stop_bytes, "bytes")
    if len(stop_token_ids) > self.max_stop_token_ids:
      n, cap = len(stop_token_ids), self.max_stop_token_ids
      raise _over(f"{field}stop_token_ids", f"{n} stop token ids", "max_stop_token_ids", cap, "per prompt")

  def tools(self, tools: list | None) -> None:
    if tools is not None and len(tools) > self.max_tools:
      raise _over("tools", f"{len(tools)} tools", "max_tools", self.max_tools, "per request")

  def prompt_bytes(self, texts: Sequence[str], field: str) -> None:
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > self.max_prompt_bytes:
      raise _over(field, f"prompt text of {size} bytes", "max_prompt_bytes", self.max_prompt_bytes, "bytes")

  def chat_bytes(self, messages: list, tools: list | None) -> None:
    """A chat's prompt text: every string in its messages and tool declarations."""
    self.prompt_bytes([*strings(messages), json.dumps(tools) if tools else ""], "messages")


def _over(field: str, what: str, cap: str, value: int, unit: str) -> InvalidRequest:
  return InvalidRequest(field, f"{what} exceed the cap {cap}={value} {unit} (launch/serve.py --{cap})")


def strings(value: Any):
  """Every string inside a JSON value (message contents may be strings or lists of parts)."""
  stack = [value]
  while stack:
    v = stack.pop()
    if isinstance(v, str):
      yield v
    elif isinstance(v, dict):
      stack.extend(v.values())
    elif isinstance(v, list):
      stack.extend(v)
