"""Which SGLang-API server is at a URL and what it supports, learned from its info routes and a route probe.

Three servers speak the same `/generate` contract but differ in what RL needs (reference §2.6):
- SGLang (GPU): `/update_weights_from_disk` and `/update_weights_from_tensor`, `weight_version` in
  `/get_model_info` and in every `meta_info`; `sampling_seed` is honoured with `--enable-deterministic-inference`.
- sglang-jax: no weight-update route at all (404), no weight version anywhere; `sampling_seed` is honoured
  with `--enable-deterministic-sampling` (its `server_args.py`, field `enable_deterministic_sampling`).
- k2jax's own server (`k2jax/serve/server.py`): names itself (`"engine": "k2jax"`) and lists its
  capabilities in `/get_server_info`.
`/get_server_info` (newer SGLang: `/server_info`) returns the server's arguments, which tell SGLang and
sglang-jax apart by their option names. Routes are probed with GET: FastAPI answers 405 for a POST-only
route that exists and 404 for one that does not, and a GET never starts work on the server.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from k2jax.engine.base import EngineCapabilities
from k2jax.transport import RetryPolicy, ServiceError, ServiceUnreachable, call_json

_ROUTES = ("update_weights_from_disk", "update_weights_from_tensor", "abort_request")


def probe_capabilities(base: str, headers: dict[str, str], timeout_s: float, retry: RetryPolicy) -> EngineCapabilities:
  """Asks the server at `base` (no trailing slash) who it is and which routes it has."""
  info = _server_info(base, headers, timeout_s, retry)
  model_info = _get_or_empty(f"{base}/get_model_info", headers, timeout_s, retry)
  routes = {r for r in _ROUTES if route_exists(f"{base}/{r}", headers, timeout_s)}
  return identify(info, model_info, routes)


def identify(info: dict, model_info: dict, routes: set[str]) -> EngineCapabilities:
  """Capabilities from `/get_server_info`, `/get_model_info` and the set of `_ROUTES` that exist."""
  updates = tuple(kind for kind in ("disk", "tensors") if _update_route(kind) in routes)
  version = info.get("version") if isinstance(info.get("version"), str) else None
  if info.get("engine") == "k2jax":
    declared = info.get("capabilities")
    if not isinstance(declared, dict):
      raise ServiceError(f"k2jax server info has no 'capabilities' object: {info!r:.200}")
    return EngineCapabilities(
      server="k2jax",
      server_version=version,
      weight_update=tuple(declared.get("weight_update", ())),
      reports_weight_version=bool(declared.get("weight_version")),
      seeded_sampling=bool(declared.get("seeded_sampling")),
      abort=bool(declared.get("abort")),
    )
  if "enable_deterministic_sampling" in info or "precompile_token_paddings" in info:
    server, seeded = "sglang-jax", bool(info.get("enable_deterministic_sampling"))
  elif "enable_deterministic_inference" in info or "tp_size" in info:
    server, seeded = "sglang", bool(info.get("enable_deterministic_inference"))
  else:
    server, seeded = "unknown", False
  return EngineCapabilities(
    server=server,
    server_version=version,
    weight_update=updates,
    reports_weight_version="weight_version" in model_info or "weight_version" in info,
    seeded_sampling=seeded,
    abort="abort_request" in routes,
  )


def route_exists(url: str, headers: dict[str, str], timeout_s: float) -> bool:
  """GET `url`: 404 means no such route; any other answer (405 for POST-only routes, 200, 4xx) means it exists."""
  req = urllib.request.Request(url, method="GET", headers=headers)
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
      resp.read()
      return True
  except urllib.error.HTTPError as e:
    e.read()
    return e.code != 404
  except (urllib.error.URLError, OSError) as e:
    raise ServiceUnreachable(f"{url}: route probe failed: {e!r}") from e


def _update_route(kind: str) -> str:
  return {"disk": "update_weights_from_disk", "tensors": "update_weights_from_tensor"}[kind]


def _server_info(base: str, headers, timeout_s, retry) -> dict:
  for route in ("get_server_info", "server_info"):
    info = _get_or_empty(f"{base}/{route}", headers, timeout_s, retry)
    if info:
      return info
  return {}


def _get_or_empty(url: str, headers, timeout_s, retry) -> dict:
  """The JSON object at `url`, or {} when the route does not exist."""
  if not route_exists(url, headers, timeout_s):
    return {}

  def check(body: Any) -> dict:
    if not isinstance(body, dict):
      raise ValueError(f"expected a JSON object, got {type(body).__name__}")
    return body

  return call_json(url, None, timeout_s=timeout_s, retry=retry, headers=headers, validate=check)
