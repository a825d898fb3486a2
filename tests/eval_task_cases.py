"""Malformed `eval.tasks.<name>` entries and the dotted key each error must name. The entry is one declaration
(k2jax/data/eval_tasks.EvalTaskEntry) read by every loop's config; tests/train/test_eval_tasks.py and
tests/rl/test_rl_eval.py run these same cases through pretraining's and RL's config boundaries."""

MALFORMED = [
  ({"path": ""}, "eval.tasks.bad.path"),
  ({"path": "x.jsonl", "format": "gsm9k"}, "eval.tasks.bad.format"),
  ({"path": "x.jsonl", "n": 2}, "eval.tasks.bad.n"),  # greedy samples would all be the same
  ({"path": "x.jsonl", "ks": (0,)}, "eval.tasks.bad.ks"),
  ({"path": "x.jsonl", "num_fewshot": 2}, "eval.tasks.bad.fewshot_file"),
  ({"path": "x.jsonl", "max_tokens": -1}, "eval.tasks.bad.max_tokens"),
  ({"path": "x.jsonl", "temperature": -1.0}, "eval.tasks.bad.temperature"),
]
