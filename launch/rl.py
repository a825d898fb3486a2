"""RL post-training (K2 §3.2.3): `python launch/rl.py --config=configs/rl.py:tiny --workdir=W`.

`--config=configs/rl.py:agentic_tiny` mixes six task types per batch (math, code, instruction following,
judge, rubric, multi-turn tool use against an env service it starts itself unless
`--config.agentic.env_urls` names one). With no `--config.rollout.engine_url` the embedded k2jax engine
runs in-process; with a URL rollouts come from that SGLang-compatible server (see
launch/sglang_server.sh and BUILD.md "RL with SGLang").
Resumes from the latest checkpoint in W; writes W/metrics.jsonl and W/checkpoints/<iteration>/.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from k2jax import compile_cache  # noqa: E402

from k2jax.rl import learner  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:tiny", "RL config file and variant.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, weight pushes).", required=True)
_COMPILE_CACHE = compile_cache.define_flag()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  compile_cache.enable(_COMPILE_CACHE.value)
  final = learner.run(_CONFIG.value, _WORKDIR.value)
  print(json.dumps({k: final[k] for k in ("step", "reward_mean", "eval_accuracy") if k in final}))


if __name__ == "__main__":
  app.run(main)
