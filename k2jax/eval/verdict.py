"""The verdict on one generated sample: a score in [0, 1] (1 = correct), the answer maj@k votes on, a reason.

It sits below the graders (`grading.py`, `swe.py`, the benchmark formats of `formats/`) and the report, which
all share it, so none of them imports another to get it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

UNGRADABLE = "ungradable: "  # a reason starting so: the grader could not judge the test, not the sample


@dataclasses.dataclass(frozen=True)
class Verdict:
  score: float
  answer: str | None  # canonical extracted answer (maj@k votes on it); None: none given, or not a voting task
  reason: str
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # more JSON fields for the sample's record
  # The grader ran out of time (math-verify's limit, a code case's, a test run's): a loaded machine can cause it,
  # so the runner stores the sample flagged and grades it again on resume; the report counts such samples.
  timed_out: bool = False


MATH_TIMEOUT = "grader timed out"  # how the math grader's reason starts when it ran out of time


def math_timed_out(reason: str) -> bool:
  return reason.startswith(MATH_TIMEOUT)
