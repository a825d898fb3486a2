"""K2 agentic data synthesis: tools -> agents -> rubric tasks -> trajectories -> judged SFT records.

  python launch/synth.py --config=configs/synth.py:tiny --out=/tmp/synth [--config.llm_url=URL]

Without --config.llm_url the embedded k2jax engine serves --config.serve_model on a free local port.
Rerunning the same command resumes; per-stage counts print as key=value lines and go to OUT/stats.json.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from k2jax.data.synth import from_config_dict, run_synth  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/synth.py:tiny")
_OUT = flags.DEFINE_string("out", None, "Output directory (stage jsonl files; reruns resume).", required=True)


def serve_locally(c, out: str):
  """Starts the embedded engine on `c.serve_model` ('tiny-random' builds a random tiny model)."""
  import k2jax
  from flax import nnx
  from k2jax.model import K2Model, presets
  from k2jax.engine import EngineConfig
  from k2jax.serve import Server

  path = c.serve_model
  if path == "tiny-random":
    path = os.path.join(out, "tiny_random_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
      k2jax.save_hf(K2Model(presets.get("tiny", max_position_embeddings=c.serve_max_seq_len), rngs=nnx.Rngs(0)), path)
  return Server(path, engine_config=EngineConfig(max_seq_len=c.serve_max_seq_len), port=0).start()


def main(argv):
  del argv
  c, server = _CONFIG.value, None
  if not c.llm_url:
    server = serve_locally(c, _OUT.value)
  try:
    stats = run_synth(from_config_dict(c, c.llm_url or server.url), _OUT.value)
  finally:
    if server is not None:
      server.close()
  for stage, counts in stats.items():
    for key, value in counts.items() if isinstance(counts, dict) else [("", counts)]:
      print(f"{stage}{'.' + key if key else ''}={value}")


if __name__ == "__main__":
  app.run(main)
