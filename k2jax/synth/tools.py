"""Stage (a): the tool repository. Real MCP tool specs imported from JSON files as-is, and synthetic
tools evolved hierarchically with an LLM (K2 §3.1.1: categories -> application domains -> specialised
tools, Evol-Instruct style), then deduplicated.

Artifacts: `domains.jsonl` (one record per category: its domains), `tool_units.jsonl` (one record per
category/domain: the valid tools the LLM proposed), `tools.jsonl` (the deduplicated repository,
rebuilt from the two above on every run; records `{id, source, category, domain, tool: MCP dict}`).
Deduplication: the same normalised name, or (within one domain) word-set Jaccard similarity of the
descriptions >= `dedup_threshold`. Pairwise comparison stays within a domain, so it costs
O(sum of domain sizes squared) rather than O(n^2) over 20k tools.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from k2jax.agentic.tools import ToolSpecError, load_tool_dicts, sanitize_name, tool_from_dict
from k2jax.synth.llm import LLM
from k2jax.synth.store import StageStore

DOMAINS_PROMPT = """ROLE: domain_generator
You design application domains for AI agents that use tools. For the category below, list {n} distinct
application domains. Answer with a JSON array of short domain names only."""

TOOLS_PROMPT = """ROLE: tool_generator
You design tools (functions) an AI agent can call, in the Model Context Protocol format. For the
domain below, propose {n} specialised tools with clear interfaces. Answer with a JSON array of objects
{{"name": snake_case, "description": what it does and returns, "inputSchema": JSON Schema with
"type": "object", "properties" and "required", "impact": "read_only" | "reversible_write" | "irreversible"}}."""


def import_mcp(paths: Sequence[str], store: StageStore) -> list[dict]:
  """Real MCP tools from JSON files; every invalid one is rejected with its reason."""
  out, done = [], store.done_ids()
  for path in paths:
    category = os.path.splitext(os.path.basename(path))[0]
    for i, raw in enumerate(load_tool_dicts(path)):
      unit = f"mcp:{category}:{i}"
      try:
        if not isinstance(raw, dict):
          raise ToolSpecError(f"{path}[{i}]: not an object")
        fixed = dict(raw, name=sanitize_name(raw.get("name", "")))
        if fixed["name"] != raw.get("name"):
          fixed.setdefault("title", str(raw.get("name")))
        spec = tool_from_dict(fixed, f"{path}[{i}]")
      except ToolSpecError as e:
        if unit not in done:
          store.reject(unit, str(e))
        continue
      out.append(
        {
          "id": unit,
          "source": "mcp",
          "category": raw.get("category", category),
          "domain": raw.get("domain", category),
          "tool": spec.to_mcp(),
        }
      )
  return out


def evolve_domains(llm: LLM, category: str, n: int) -> list[str]:
  value = llm.json(
    [{"role": "system", "content": DOMAINS_PROMPT.format(n=n)}, {"role": "user", "content": f"Category: {category}"}],
    role="domain_generator",
  )
  domains = [d.strip() for d in value if isinstance(d, str) and d.strip()] if isinstance(value, list) else []
  if not domains:
    raise llm.invalid("domain_generator", f"expected a JSON array of strings, got {str(value)[:100]}")
  return list(dict.fromkeys(domains))[:n]


def evolve_tools(llm: LLM, category: str, domain: str, n: int) -> tuple[list[dict], int]:
  """(valid MCP tool dicts, number of invalid ones) proposed for one domain."""
  value = llm.json(
    [
      {"role": "system", "content": TOOLS_PROMPT.format(n=n)},
      {"role": "user", "content": f"Category: {category}\nDomain: {domain}"},
    ],
    role="tool_generator",
  )
  if not isinstance(value, list):
    raise llm.invalid("tool_generator", "expected a JSON array of tools")
  tools, invalid = [], 0
  for raw in value[:n]:
    try:
      tools.append(tool_from_dict(raw, f"{category}/{domain}").to_mcp())
    except ToolSpecError:
      invalid += 1
  if not tools:
    raise llm.invalid("tool_generator", f"none of {len(value)} proposed tools is valid")
  return tools, invalid


def build_repository(imported: list[dict], units: list[dict], threshold: float) -> tuple[list[dict], int]:
  """Deduplicated tool records (imported first) and how many duplicates were dropped."""
  candidates = list(imported)
  for unit in units:
    for t in unit["tools"]:
      candidates.append(
        {
          "id": f"syn:{unit['category']}/{unit['domain']}/{t['name']}",
          "source": "synthetic",
          "category": unit["category"],
          "domain": unit["domain"],
          "tool": t,
        }
      )
  kept, names, by_domain, dropped = [], set(), {}, 0
  for rec in candidates:
    key = _norm_name(rec["tool"]["name"])
    words = _words(rec["tool"].get("description", ""))
    same_domain = by_domain.setdefault(rec["domain"], [])
    if key in names or any(_jaccard(words, w) >= threshold for w in same_domain):
      dropped += 1
      continue
    names.add(key)
    same_domain.append(words)
    kept.append(rec)
  return kept, dropped


def _norm_name(name: str) -> str:
  return re.sub(r"[^a-z0-9]", "", name.lower())


def _words(text: str) -> frozenset[str]:
  return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def _jaccard(a: frozenset, b: frozenset) -> float:
  return len(a & b) / len(a | b) if a and b else 0.0
