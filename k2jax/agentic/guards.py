"""Guards on what agents may do: impact confirmation, per-target rate limits, a concurrency cap, egress.

`Guard.run(tool, call, fn)` is the only way a tool implementation is executed:
1. Impact: a tool above `GuardConfig.max_unconfirmed_impact` runs only if the `confirm` callback says
   yes. The default callback denies (training has nobody to ask). Every decision is logged.
2. Network: the implementation gets a `Net` handle that reaches only the tool's declared `targets`
   (redirects are not followed and environment proxies not used: a request goes to the target checked);
   every request waits for the target's rate limiter and the global concurrency cap, so a thousand
   parallel agents cannot flood one external service. No targets = no network.
3. Errors raised by the implementation become `ToolError("tool_failed")`, never a crash.

Rate limiting is GCRA (a token bucket with reservations): each request reserves the next free slot of
its target; at most `burst + rate * window` requests start in any window. A request that would wait
longer than `max_wait_s` is refused (`rate_limited`) instead of queuing without bound.
The limiter is per process: with R service replicas give each `rate / R` (see docs/agentic.md).

`install_egress_hook` adds the process-wide layer: a Python audit hook refusing `socket.connect` to
any address outside an allowlist (environment services call it at start-up; the Kubernetes
NetworkPolicy in deploy/ is the boundary, this hook the in-process guard rail).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping

from k2jax.agentic.calls import ToolCall, ToolError
from k2jax.agentic.tools import Impact, ToolSpec

log = logging.getLogger(__name__)

ConfirmFn = Callable[[ToolSpec, ToolCall], bool]


def deny_all(tool: ToolSpec, call: ToolCall) -> bool:
  """The training default: nobody is there to confirm, so high-impact actions are refused."""
  return False


@dataclasses.dataclass(frozen=True)
class RateLimit:
  rate_per_s: float
  burst: int = 1

  def __post_init__(self):
    if self.rate_per_s <= 0 or self.burst < 1:
      raise ValueError(f"RateLimit needs rate_per_s > 0 and burst >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  max_unconfirmed_impact: Impact = Impact.REVERSIBLE_WRITE
  default_rate: RateLimit = RateLimit(rate_per_s=10.0, burst=5)
  target_rates: tuple[tuple[str, RateLimit], ...] = ()  # per "host:port" overrides
  max_concurrency: int = 64  # external requests in flight at once, all targets together
  max_wait_s: float = 30.0  # longest a request may queue for its rate slot / concurrency
  request_timeout_s: float = 10.0
  audit_path: str | None = None  # jsonl audit log (also kept in memory)


class RateLimiter:
  """GCRA for one target: `reserve()` returns the start time granted, or None if too far out."""

  def __init__(self, limit: RateLimit):
    self.interval = 1.0 / limit.rate_per_s
    self.tolerance = (limit.burst - 1) * self.interval
    self._tat = 0.0  # theoretical arrival time of the next request
    self._lock = threading.Lock()

  def reserve(self, max_wait_s: float) -> float | None:
    with self._lock:
      now = time.monotonic()
      tat = max(self._tat, now)
      start = max(now, tat - self.tolerance)
      if start - now > max_wait_s:
        return None
      self._tat = tat + self.interval
      return start


class Net:
  """Network access for one tool call: only the tool's targets, rate limited, concurrency capped."""

  def __init__(self, guard: "Guard", tool: ToolSpec):
    self._guard, self._tool = guard, tool

  def request_json(self, target: str, path: str, payload: Any | None = None) -> Any:
    """POST (GET when payload is None) `http://{target}{path}`; raises ToolFailure on refusal."""
    g, cfg = self._guard, self._guard.config
    if target not in self._tool.targets:
      g.audit("no_network", self._tool.name, {"target": target})
      raise ToolFailure(
        "no_network", f"tool {self._tool.name!r} may not reach {target!r} (allowed: {list(self._tool.targets)})"
      )
    start = g.limiter(target).reserve(cfg.max_wait_s)
    if start is None:
      g.audit("rate_limited", self._tool.name, {"target": target})
      raise ToolFailure("rate_limited", f"rate limit for {target} exceeded; retry later")
    time.sleep(max(0.0, start - time.monotonic()))
    if not g._inflight.acquire(timeout=cfg.max_wait_s):
      raise ToolFailure("rate_limited", f"{cfg.max_concurrency} external requests already in flight")
    try:
      data = None if payload is None else json.dumps(payload).encode()
      req = urllib.request.Request(f"http://{target}{path}", data=data, headers={"Content-Type": "application/json"})
      with _OPENER.open(req, timeout=cfg.request_timeout_s) as resp:
        body = resp.read()
      return json.loads(body) if body else None
    except urllib.error.HTTPError as e:
      location = e.headers.get("Location") if 300 <= e.code < 400 else None
      if location is not None:  # the check above was for `target` only: a redirect would leave it
        g.audit("redirect_refused", self._tool.name, {"target": target, "path": path, "location": location})
        raise ToolFailure(
          "no_network", f"{target}{path} redirected (HTTP {e.code}) to {location!r}: redirects are not followed"
        ) from None
      raise ToolFailure("tool_failed", f"request to {target}{path} failed: {e}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
      raise ToolFailure("tool_failed", f"request to {target}{path} failed: {e}") from None
    finally:
      g._inflight.release()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
  """urllib follows 3xx by default, past the per-target check: here a 3xx stays an HTTPError."""

  def redirect_request(self, req, fp, code, msg, headers, newurl):
    return None


# No redirects, and no proxy from the environment (HTTP_PROXY would carry every request to one host the
# tool never declared).
_OPENER = urllib.request.build_opener(_NoRedirect(), urllib.request.ProxyHandler({}))


class ToolFailure(Exception):
  """Raised inside a tool implementation to return a specific ToolError kind."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


ToolFn = Callable[[Mapping[str, Any], Net], Any]


class Guard:
  """Shared by all episodes of a process (thread-safe)."""

  def __init__(self, config: GuardConfig = GuardConfig(), confirm: ConfirmFn = deny_all):
    self.config, self.confirm = config, confirm
    self._rates = dict(config.target_rates)
    self._limiters: dict[str, RateLimiter] = {}
    self._inflight = threading.BoundedSemaphore(config.max_concurrency)
    self._lock = threading.Lock()
    self.audit_log: list[dict] = []

  def limiter(self, target: str) -> RateLimiter:
    with self._lock:
      if target not in self._limiters:
        self._limiters[target] = RateLimiter(self._rates.get(target, self.config.default_rate))
      return self._limiters[target]

  def run(self, tool: ToolSpec, call: ToolCall, fn: ToolFn) -> Any:
    """fn(arguments, net) under the guards; returns its result or a ToolError."""
    if tool.impact > self.config.max_unconfirmed_impact:
      try:
        ok = bool(self.confirm(tool, call))
      except Exception as e:  # a broken confirmation hook must deny, not crash the episode
        log.warning("confirm callback failed for %s: %s", tool.name, e)
        ok = False
      self.audit(
        "confirmed" if ok else "denied",
        tool.name,
        {"impact": tool.impact.name, "arguments": call.arguments, "call_id": call.call_id},
      )
      if not ok:
        return ToolError(
          "denied",
          f"{tool.name} has impact {tool.impact.name.lower()} and needs confirmation, which was refused",
          call.call_id,
          tool.name,
        )
    try:
      return fn(call.arguments, Net(self, tool))
    except ToolFailure as e:
      return ToolError(e.kind, str(e), call.call_id, tool.name)
    except Exception as e:  # tool code is environment code: report its failure to the agent
      log.debug("tool %s failed", tool.name, exc_info=True)
      return ToolError("tool_failed", f"{type(e).__name__}: {e}"[:300], call.call_id, tool.name)

  def audit(self, event: str, tool: str, details: Mapping[str, Any]) -> None:
    entry = {"time": time.time(), "event": event, "tool": tool, **details}
    with self._lock:
      self.audit_log.append(entry)
      if self.config.audit_path:
        with open(self.config.audit_path, "a", encoding="utf-8") as f:
          f.write(json.dumps(entry, default=str) + "\n")


_EGRESS_ALLOWED: set[tuple[str, int]] | None = None


def install_egress_hook(allowed_targets: set[str]) -> None:
  """Refuses `socket.connect` to any (ip, port) outside `allowed_targets` ("host:port") for the
  rest of the process. Idempotent; later calls add to the allowlist (audit hooks cannot be removed)."""
  global _EGRESS_ALLOWED
  resolved = set()
  for target in allowed_targets:
    host, port = target.rsplit(":", 1)
    for info in socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP):
      resolved.add((info[4][0], int(port)))
  if _EGRESS_ALLOWED is None:
    _EGRESS_ALLOWED = resolved
    sys.addaudithook(_egress_hook)
  else:
    _EGRESS_ALLOWED |= resolved


def _egress_hook(event: str, args: tuple) -> None:
  if event == "socket.connect" and _EGRESS_ALLOWED is not None:
    address = args[1]
    if isinstance(address, tuple) and len(address) >= 2 and (address[0], address[1]) not in _EGRESS_ALLOWED:
      raise PermissionError(f"egress to {address[0]}:{address[1]} is not allowed in this environment")
