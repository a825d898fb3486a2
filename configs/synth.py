"""K2 agentic data synthesis configs: `tiny` (CPU smoke run against the embedded random tiny model)
and `default` (a real run against an OpenAI-compatible endpoint serving a strong model).

  python launch/synth.py --config=configs/synth.py:tiny --out=/tmp/synth
  python launch/synth.py --config=configs/synth.py:default --out=W/synth \
      --config.llm_url=http://sglang:30000 --config.num_agents=2000 --config.concurrency=256

With `llm_url` empty the launcher serves `serve_model` (a workdir/HF dir, or `tiny-random`) with the
embedded k2jax engine on a free local port. Each stage writes OUT/<stage>.jsonl and
OUT/<stage>.rejected.jsonl; rerunning the same command resumes. OUT/sft.jsonl is SFT data
(`--config.data.kind=sft --config.data.path=OUT/sft.jsonl` in configs/k2.py).
"""

from ml_collections import config_dict

from k2jax import configlib
from k2jax.synth.pipeline import SynthSpec

VARIANTS = ("tiny", "default")


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"configs/synth.py: unknown variant {arg!r}; choose one of {VARIANTS}")
  c = configlib.config_dict(SynthSpec)  # k2jax/synth/pipeline.py:SynthSpec declares every key, default and doc
  if arg == "tiny":
    c.max_tokens = 32
    c.agent_max_tokens = 32
    c.categories = ("software applications",)
    c.domains_per_category = 1
    c.num_agents = 2
    c.tasks_per_agent = 1
    c.max_turns = 2
    c.workers = 2
    c.concurrency = 2
  c.lock()
  return c
