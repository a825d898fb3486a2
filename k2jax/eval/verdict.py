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
