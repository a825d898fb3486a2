"""Tool specs and the tool registry: MCP and OpenAI tool forms in, OpenAI/K2 form out.

A `ToolSpec` is one tool as the agent sees it (name, description, JSON Schema of its arguments) plus
what the runtime needs to guard it: its impact level and the network targets it may reach.

Accepted input forms (reference k2-data-and-synthesis.md §5):
- MCP `Tool`: `{name, title?, description?, inputSchema, annotations?}`; a `tools/list` result
  `{"tools": [...]}` is accepted too. Impact comes from the annotations (hints, defaults as in MCP):
  readOnlyHint -> READ_ONLY; destructiveHint false -> REVERSIBLE_WRITE; otherwise (MCP's default
  destructiveHint is true) IRREVERSIBLE. Unannotated tools are therefore treated as irreversible.
- OpenAI `tools[]` entry: `{type: "function", function: {name, description?, parameters?}}`.
- Either form may carry k2jax's own keys `impact` ("read_only" | "reversible_write" | "irreversible")
  and `targets` (["host:port", ...]); they override the MCP hints.

Schemas are checked with `jsonschema` (Draft 2020-12, the dialect later MCP revisions name) when the
tool is registered, so a bad schema fails at load time naming the tool, never during a rollout.
Names must match OpenAI's `^[A-Za-z0-9_-]{1,64}$`, which also keeps K2 call ids
(`functions.{name}:{idx}`) unambiguous; `sanitize_name` maps other MCP names onto it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import jsonschema

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TARGET = re.compile(r"^[A-Za-z0-9.-]+:\d{1,5}$")


class Impact(enum.IntEnum):
  """What a call can do to the world; guards compare these levels."""

  READ_ONLY = 0
  REVERSIBLE_WRITE = 1
  IRREVERSIBLE = 2  # irreversible, or a side effect outside the environment


class ToolSpecError(ValueError):
  """A tool spec that cannot be used; the message names the file/tool and field."""


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  name: str
  description: str
  input_schema: Mapping[str, Any]
  impact: Impact = Impact.IRREVERSIBLE
  targets: tuple[str, ...] = ()  # network targets ("host:port") this tool may reach; none = no network
  title: str | None = None

  def __post_init__(self):
    where = f"tool {self.name!r}"
    if not isinstance(self.name, str) or not _NAME.match(self.name):
      raise ToolSpecError(f"{where}: name must match {_NAME.pattern}")
    if not isinstance(self.description, str):
      raise ToolSpecError(f"{where}: description must be a string")
    if not isinstance(self.input_schema, Mapping) or self.input_schema.get("type") != "object":
      raise ToolSpecError(f"{where}: inputSchema must be a JSON Schema object with type 'object'")
    try:
      jsonschema.Draft202012Validator.check_schema(dict(self.input_schema))
    except jsonschema.SchemaError as e:
      raise ToolSpecError(f"{where}: invalid inputSchema: {e.message}") from None
    for t in self.targets:
      if not isinstance(t, str) or not _TARGET.match(t):
        raise ToolSpecError(f"{where}: target {t!r} is not 'host:port'")

  def to_openai(self) -> dict:
    """The OpenAI `tools[]` entry (the JSON K2's chat template declares)."""
    return {
      "type": "function",
      "function": {"name": self.name, "description": self.description, "parameters": dict(self.input_schema)},
    }

  def to_mcp(self) -> dict:
    hints = {
      Impact.READ_ONLY: {"readOnlyHint": True, "destructiveHint": False},
      Impact.REVERSIBLE_WRITE: {"readOnlyHint": False, "destructiveHint": False},
      Impact.IRREVERSIBLE: {"readOnlyHint": False, "destructiveHint": True},
    }[self.impact]
    out = {
      "name": self.name,
      "description": self.description,
      "inputSchema": dict(self.input_schema),
      "annotations": hints,
      "impact": self.impact.name.lower(),
    }
    if self.targets:
      out["targets"] = list(self.targets)
    if self.title is not None:
      out["title"] = self.title
    return out


def tool_from_dict(d: Any, where: str = "tool") -> ToolSpec:
  """A ToolSpec from an MCP `Tool` or an OpenAI `tools[]` entry (see module docstring)."""
  if not isinstance(d, Mapping):
    raise ToolSpecError(f"{where}: must be an object, got {type(d).__name__}")
  if d.get("type") == "function" or "function" in d:
    fn = d.get("function")
    if not isinstance(fn, Mapping):
      raise ToolSpecError(f"{where}: OpenAI tool needs a 'function' object")
    name, desc = fn.get("name"), fn.get("description", "")
    schema = fn.get("parameters") or {"type": "object", "properties": {}}
    impact = _impact(d.get("impact", fn.get("impact")), None, where)
    targets = d.get("targets", fn.get("targets", ()))
    title = None
  else:
    name, desc = d.get("name"), d.get("description", "")
    schema = d.get("inputSchema")
    if schema is None:
      raise ToolSpecError(f"{where} ({name!r}): MCP tool needs 'inputSchema'")
    impact = _impact(d.get("impact"), d.get("annotations"), where)
    targets = d.get("targets", ())
    title = d.get("title")
  if not isinstance(targets, (list, tuple)):
    raise ToolSpecError(f"{where}: targets must be a list of 'host:port'")
  try:
    return ToolSpec(
      name=name, description=desc or "", input_schema=schema, impact=impact, targets=tuple(targets), title=title
    )
  except ToolSpecError as e:
    raise ToolSpecError(f"{where}: {e}") from None


def sanitize_name(name: str) -> str:
  """Maps an arbitrary (MCP) tool name onto `^[A-Za-z0-9_-]{1,64}$`."""
  out = re.sub(r"[^A-Za-z0-9_-]+", "_", str(name)).strip("_")[:64]
  return out or "tool"


class ToolRegistry:
  """Tools by name. Not locked: build it once, then share it read-only between threads."""

  def __init__(self, tools: Iterable[ToolSpec] = ()):
    self._tools: dict[str, ToolSpec] = {}
    self._validators: dict[str, jsonschema.protocols.Validator] = {}
    for t in tools:
      self.add(t)

  def add(self, tool: ToolSpec) -> None:
    if tool.name in self._tools:
      raise ToolSpecError(f"tool {tool.name!r} is registered twice")
    self._tools[tool.name] = tool
    self._validators[tool.name] = jsonschema.Draft202012Validator(dict(tool.input_schema))

  def __contains__(self, name: object) -> bool:
    return name in self._tools

  def __getitem__(self, name: str) -> ToolSpec:
    return self._tools[name]

  def __len__(self) -> int:
    return len(self._tools)

  @property
  def names(self) -> list[str]:
    return list(self._tools)

  def validator(self, name: str) -> jsonschema.protocols.Validator:
    return self._validators[name]

  def openai_tools(self, names: Sequence[str] | None = None) -> list[dict]:
    """OpenAI `tools` for `names` (all when None), ready for `k2jax.data.chat.render_chat`."""
    names = self.names if names is None else names
    missing = [n for n in names if n not in self._tools]
    if missing:
      raise KeyError(f"tools not in the registry: {missing}")
    return [self._tools[n].to_openai() for n in names]

  def subset(self, names: Sequence[str]) -> "ToolRegistry":
    return ToolRegistry(self._tools[n] for n in names)

  @classmethod
  def from_dicts(cls, items: Sequence[Any], where: str = "tools") -> "ToolRegistry":
    return cls(tool_from_dict(d, f"{where}[{i}]") for i, d in enumerate(items))

  @classmethod
  def load_json(cls, path: str) -> "ToolRegistry":
    """Tools from a JSON file: a list of tools, or an MCP `tools/list` result `{"tools": [...]}`."""
    return cls.from_dicts(load_tool_dicts(path), where=path)


def load_tool_dicts(path: str) -> list:
  """The raw tool objects of a JSON (or jsonl) tool file, with the path in every error."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tool file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    data = json.loads(text) if not path.endswith(".jsonl") else [json.loads(l) for l in text.splitlines() if l.strip()]
  except ValueError as e:
    raise ToolSpecError(f"{path}: not valid JSON: {e}") from None
  if isinstance(data, Mapping) and isinstance(data.get("tools"), list):
    data = data["tools"]
  if not isinstance(data, list):
    raise ToolSpecError(f"{path}: expected a list of tools or {{'tools': [...]}}")
  return data


def _impact(explicit: Any, annotations: Any, where: str) -> Impact:
  if explicit is not None:
    try:
      return Impact[str(explicit).upper()]
    except KeyError:
      raise ToolSpecError(f"{where}: impact {explicit!r} is not one of {[i.name.lower() for i in Impact]}") from None
  ann = annotations if isinstance(annotations, Mapping) else {}
  if ann.get("readOnlyHint") is True:
    return Impact.READ_ONLY
  if ann.get("destructiveHint") is False:
    return Impact.REVERSIBLE_WRITE
  return Impact.IRREVERSIBLE
