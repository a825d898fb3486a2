"""Problem statements for built tasks: from templates (no model needed), or written by an LLM through
`k2jax.llm_client` when an endpoint is configured, under a "describe the symptom, never the fix" rule.

Templates follow SWE-smith's static styles (`issue_gen/get_static.py`: the failing tests plus a truncated
failure message), and name the public function whose behaviour changed, never the line or the change.
Version-diff tasks use the changelog entry the package itself ships (`changelog_entry`).
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence

_TEMPLATES = (
  "`{module}.{function}` gives wrong results since the last change.\n\nThese tests fail:\n{tests}\n\n"
  "{failure}Please fix the library code (not the tests) so that they pass again.",
  "Bug report: calling `{function}` from `{module}` no longer behaves as documented.\n\nFailing tests:\n{tests}\n\n"
  "{failure}The tests are right; the implementation needs fixing.",
)
_LLM_PROMPT = (
  "Write a short GitHub issue (under 120 words) reporting the bug that makes these tests fail. Describe the "
  "symptom a user would see. Do NOT say how to fix it, which line is wrong, or quote the diff.\n\n"
  "Failing tests:\n{tests}\n\nTest output (end):\n{output}\n\nThe change that introduced the bug (hidden from the "
  "reader):\n{diff}"
)
_HEADING = re.compile(r"^(#+\s*|\s*)v?(\d[\w.\-]*)\b.*$|^(\d[\w.\-]*)\s*\(.*\)\s*$")


class TextLLM(Protocol):
  def text(self, messages: Sequence[dict]) -> str: ...


def bug_statement(
  functions: Sequence[tuple[str, str]],
  fail_to_pass: Sequence[str],
  failure: str,
  seed: int,
  llm: TextLLM | None = None,
  diff: str = "",
) -> str:
  """The issue text for an injected bug in `functions` ((module, function) pairs) failing `fail_to_pass`."""
  tests = "\n".join(f"- `{t}`" for t in list(fail_to_pass)[:8])
  if llm is not None:
    text = llm.text([{"role": "user", "content": _LLM_PROMPT.format(tests=tests, output=failure[-1500:], diff=diff)}])
    if text.strip():
      return text.strip()
  module, function = functions[0]
  short = _failure_excerpt(failure)
  block = f"The failure looks like:\n```\n{short}\n```\n\n" if short else ""
  return _TEMPLATES[seed % len(_TEMPLATES)].format(module=module, function=function, tests=tests, failure=block)


def changelog_entry(text: str, version: str) -> str:
  """The section of a changelog (markdown or rst) for `version`: the lines under its heading up to the next
  version heading. Empty when the version has no section."""
  lines = text.splitlines()
  start = None
  for i, line in enumerate(lines):
    m = _HEADING.match(line.strip())
    found = m and (m.group(2) or m.group(3))
    if start is None and found == version:
      start = i + 1
    elif start is not None and found and found != version and _is_heading(lines, i):
      return "\n".join(lines[start:i]).strip("\n -=~").strip()
  return "\n".join(lines[start:]).strip("\n -=~").strip() if start is not None else ""


def _is_heading(lines: list[str], i: int) -> bool:
  line = lines[i].strip()
  underline = i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("=-~^") and lines[i + 1].strip()
  return line.startswith("#") or bool(underline) or bool(re.match(r"^v?\d[\w.\-]*\s*(\(.*\))?\s*$", line))


def _failure_excerpt(output: str, lines: int = 6) -> str:
  """The assertion lines of a pytest failure ('E   ...'), at most `lines` of them."""
  picked = [x.strip() for x in output.splitlines() if x.startswith("E ")]
  return "\n".join(picked[:lines])[:600]
