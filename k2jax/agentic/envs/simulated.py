"""A stateful simulated-tools environment: a small office world with deterministic Python tools.

World state per episode: `files` (name -> text), `trash`, `accounts` (name -> balance in cents),
`outbox` (sent emails). Tools span the three impact levels, so the guards matter: reading is
read-only, writing and deleting files are reversible (delete moves to the trash), transfers and
emails are irreversible (denied in training unless the guard's confirm callback allows them).

A task: `{"id", "instruction", "state"?: initial world, "checks": [...], "followups"?: [user turns],
"max_turns"?, "tools"?: subset}`; the reward is the share of checks that hold at the end:
  {"kind": "file_equals", "name", "text"}   {"kind": "file_absent", "name"}
  {"kind": "balance", "account", "cents"}   {"kind": "email_sent", "to"}
  {"kind": "answer_contains", "text"}       (in the final assistant message)
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from k2jax.agentic.guards import Guard, GuardConfig, ToolFailure
from k2jax.agentic.tools import Impact, ToolRegistry, ToolSpec
from k2jax.agentic.envs.base import ToolEnvironment

_STR = {"type": "string", "minLength": 1, "maxLength": 200}


def _schema(props: dict, required: list[str]) -> dict:
  return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


TOOLS = (
  ToolSpec("list_files", "List the names of all files.", _schema({}, []), Impact.READ_ONLY),
  ToolSpec("read_file", "Read a file's text.", _schema({"name": _STR}, ["name"]), Impact.READ_ONLY),
  ToolSpec(
    "write_file",
    "Create or overwrite a file.",
    _schema({"name": _STR, "text": {"type": "string", "maxLength": 4000}}, ["name", "text"]),
    Impact.REVERSIBLE_WRITE,
  ),
  ToolSpec("delete_file", "Move a file to the trash.", _schema({"name": _STR}, ["name"]), Impact.REVERSIBLE_WRITE),
  ToolSpec(
    "restore_file", "Restore a file from the trash.", _schema({"name": _STR}, ["name"]), Impact.REVERSIBLE_WRITE
  ),
  ToolSpec("get_balance", "Balance of an account in cents.", _schema({"account": _STR}, ["account"]), Impact.READ_ONLY),
  ToolSpec(
    "transfer",
    "Transfer money between accounts (cannot be undone).",
    _schema({"source": _STR, "dest": _STR, "cents": {"type": "integer", "minimum": 1}}, ["source", "dest", "cents"]),
    Impact.IRREVERSIBLE,
  ),
  ToolSpec(
    "send_email",
    "Send an email (leaves the system).",
    _schema({"to": _STR, "subject": _STR, "body": {"type": "string", "maxLength": 4000}}, ["to", "subject", "body"]),
    Impact.IRREVERSIBLE,
  ),
)


def _file(state: dict, name: str) -> str:
  if name not in state["files"]:
    raise ToolFailure("tool_failed", f"no file named {name!r}")
  return state["files"][name]


def _account(state: dict, name: str) -> int:
  if name not in state["accounts"]:
    raise ToolFailure("tool_failed", f"no account named {name!r}")
  return state["accounts"][name]


def _delete(a, net, s):
  s["trash"][a["name"]] = _file(s, a["name"])
  del s["files"][a["name"]]
  return {"deleted": a["name"]}


def _restore(a, net, s):
  if a["name"] not in s["trash"]:
    raise ToolFailure("tool_failed", f"{a['name']!r} is not in the trash")
  s["files"][a["name"]] = s["trash"].pop(a["name"])
  return {"restored": a["name"]}


def _transfer(a, net, s):
  if _account(s, a["source"]) < a["cents"]:
    raise ToolFailure("tool_failed", f"insufficient funds in {a['source']!r}")
  _account(s, a["dest"])
  s["accounts"][a["source"]] -= a["cents"]
  s["accounts"][a["dest"]] += a["cents"]
  return {"ok": True, "source_balance": s["accounts"][a["source"]]}


IMPLS = {
  "list_files": lambda a, net, s: sorted(s["files"]),
  "read_file": lambda a, net, s: _file(s, a["name"]),
  "write_file": lambda a, net, s: (s["files"].__setitem__(a["name"], a["text"]), {"written": a["name"]})[1],
  "delete_file": _delete,
  "restore_file": _restore,
  "get_balance": lambda a, net, s: {"account": a["account"], "cents": _account(s, a["account"])},
  "transfer": _transfer,
  "send_email": lambda a, net, s: (s["outbox"].append(dict(a)), {"sent": True})[1],
}


class SimToolsEnv(ToolEnvironment):
  def __init__(self, guard: Guard | None = None, max_turns: int = 8):
    super().__init__(ToolRegistry(TOOLS), IMPLS, guard or Guard(GuardConfig()), max_turns)

  def initial_state(self, task: Mapping[str, Any]) -> dict:
    state = {"files": {}, "trash": {}, "accounts": {}, "outbox": []}
    state.update(copy.deepcopy(dict(task.get("state", {}))))
    return state

  def score(self, task, state, final) -> tuple[float, dict]:
    checks = task.get("checks", [])
    passed = [_check(c, state, final.get("content") or "") for c in checks]
    reward = sum(passed) / len(passed) if passed else 0.0
    return reward, {"checks_passed": sum(passed), "checks": len(passed)}


def _check(c: Mapping[str, Any], state: dict, answer: str) -> bool:
  kind = c.get("kind")
  if kind == "file_equals":
    return state["files"].get(c["name"]) == c["text"]
  if kind == "file_absent":
    return c["name"] not in state["files"]
  if kind == "balance":
    return state["accounts"].get(c["account"]) == c["cents"]
  if kind == "email_sent":
    return any(m["to"] == c["to"] for m in state["outbox"])
  if kind == "answer_contains":
    return str(c["text"]).lower() in answer.lower()
  raise ValueError(f"unknown check kind {kind!r} (task check {c!r})")
