"""IFEval (google/IFEval: key, prompt, instruction_id_list, kwargs) graded by its verifiable instructions
(`k2jax.grading.ifeval`, shared with the RL instruction reward), with lm-evaluation-harness's four metrics:
prompt_level_strict_acc (a sample's score: every instruction followed), inst_level_strict_acc (instructions
followed over all instructions), and both again loose (the response's loose variants). K2 reports
prompt-level strict.

A row's instruction ids and kwargs are checked when the file is read (an unknown id, a missing or wrong
kwarg: an error naming file, line and field); so is the data an instruction type needs (NLTK's Punkt model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k2jax.eval.records import Doc, TaskFormat, record_id, str_field
from k2jax.eval.verdict import Verdict
from k2jax.grading import ifeval

METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


def parse(r: Mapping[str, Any], i: int) -> Doc:
  prompt = str_field(r, "prompt")
  ids, kwargs = r["instruction_id_list"], r["kwargs"]
  if not isinstance(ids, list) or not ids or not all(isinstance(x, str) for x in ids):
    raise TypeError("field 'instruction_id_list' must be a non-empty list of strings")
  if not isinstance(kwargs, list) or len(kwargs) != len(ids):
    raise TypeError(f"field 'kwargs' must be a list of {len(ids)} objects, one per instruction")
  for j, (instruction, kw) in enumerate(zip(ids, kwargs)):
    try:
      ifeval.checked_kwargs(instruction, kw)
    except (TypeError, ValueError, ifeval.MissingData) as e:
      field = "instruction_id_list" if not ifeval.known(instruction) else "kwargs"
      raise ValueError(f"field '{field}'[{j}]: {e}") from None
  data = {"prompt": prompt, "instruction_id_list": list(ids), "kwargs": [dict(k) for k in kwargs]}
  return Doc(record_id(r, ("key",), i), prompt, "", data)


def grade(doc: Doc, text: str, code: Any = None) -> Verdict:
  ids, kwargs, prompt = doc.data["instruction_id_list"], doc.data["kwargs"], doc.data["prompt"]
  strict = ifeval.follows(ids, kwargs, prompt, text, loose=False)
  loose = ifeval.follows(ids, kwargs, prompt, text, loose=True)
  failed = [i for i, ok in zip(ids, strict) if not ok]
  reason = "all instructions followed" if not failed else "not followed: " + ", ".join(failed)
  return Verdict(float(all(strict)), None, reason, {"inst_strict": strict, "inst_loose": loose})


def aggregate(doc_samples: list[list[dict]]) -> dict[str, float]:
  """lm-eval's four IFEval metrics over every sample (prompt level: the mean over docs of each doc's mean)."""
  out = {}
  for mode in ("strict", "loose"):
    lists = [[s[f"inst_{mode}"] for s in samples] for samples in doc_samples]
    prompt = [sum(all(x) for x in per_doc) / len(per_doc) for per_doc in lists]
    flat = [ok for per_doc in lists for x in per_doc for ok in x]
    out[f"prompt_level_{mode}_acc"] = sum(prompt) / len(prompt)
    out[f"inst_level_{mode}_acc"] = sum(flat) / len(flat)
  return {k: out[k] for k in METRICS}


# "2": the language checks seed langdetect (unseeded, "1" could flip a verdict on short text between runs)
FORMATS = (TaskFormat("ifeval", "generate", parse, grade=grade, aggregate=aggregate, version="2"),)
