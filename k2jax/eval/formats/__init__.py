"""The benchmarks the K2 report quotes, read from their published files (JSONL, Parquet or CSV, the published
field names; nothing downloaded), one module each, with the format's own grader:

  aime, math500             math_answers.py  AIME 2024/2025 (integer answers), MATH-500; the RL math reward
  gpqa, gpqa.ll             choices.py       GPQA-Diamond: generative ("Answer: X") and by log-likelihood
  mmlu_pro, mmlu_pro.ll     choices.py       MMLU-Pro: generative ("The answer is (X)") and by log-likelihood
  ifeval                    ifeval.py        IFEval: strict / loose, prompt- and instruction-level accuracy
  livecodebench[@START..END] livecodebench.py code_generation_lite rows, graded by k2jax.sandbox.verify
  humaneval_plus, mbpp_plus evalplus.py      EvalPlus: base and plus inputs, the canonical solution's outputs
  swebench@ROOT|MAP.json    swebench.py      SWE-bench Verified rows, graded by k2jax.swe.grade against the
                                             user's checkouts and Python environments
"""

from k2jax.eval.formats import choices, evalplus, ifeval, livecodebench, math_answers, swebench

FORMATS = {
  f.name: f for module in (math_answers, choices, ifeval, livecodebench, evalplus, swebench) for f in module.FORMATS
}
PARAMETRIZED = {**livecodebench.PARAMETRIZED, **swebench.PARAMETRIZED}  # NAME@ARG formats: NAME -> (ARG -> TaskFormat)

__all__ = ["FORMATS", "PARAMETRIZED"]
