"""Convert between a Hugging Face Kimi-K2 directory and a k2jax workdir (direction from `--src`).

  python launch/convert.py --src=HF_DIR --dst=WORKDIR                     # HF -> k2jax workdir
  python launch/convert.py --src=WORKDIR --dst=HF_DIR [--dtype=bfloat16]  # k2jax -> HF safetensors

HF -> WORKDIR runs on any number of processes (--coordinator_address/--num_processes/--process_id, or
the cluster's own environment on a TPU pod): the model is laid out over all devices (--mesh, --rules),
each process reads only the byte ranges of its own slices (`k2jax.convert.reader`; the release's
block-FP8 is dequantized on the way, into --dtype or the source's dtype) and writes its own orbax
shards; process 0 swaps the workdir into place. --dst must be on a filesystem every process shares.

The HF side is the published layout (DeepseekV3ForCausalLM, per-expert keys, sharded safetensors
with model.safetensors.index.json), loadable by transformers, SGLang and vLLM. A workdir converts
from its latest checkpoint.

--dst must be new, empty, or an earlier export of this tool (and must not contain --src); an earlier
export is replaced atomically: readers see the old one or the new one, never a mix or nothing.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

flags.DEFINE_string("src", None, "HF directory (has config.json) or k2jax workdir (has model_config.json).")
flags.DEFINE_string("dst", None, "Output directory (k2jax workdir or HF directory).")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Weight dtype written (default: the source's).")
flags.DEFINE_string("mesh", "fsdp=-1", "Mesh axes, e.g. 'fsdp=-1' or 'fsdp=64,expert=8'.")
flags.DEFINE_string("rules", "fsdp", "k2jax.sharding rules preset (fsdp | fsdp_ep | fsdp_ep_tp).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR or the cluster).")
flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
flags.DEFINE_integer("read_budget_bytes", 2 << 30, "HF -> WORKDIR: host bytes of HF blocks in flight per process.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  import k2jax
  from k2jax import distributed
  from k2jax.convert import workdir as wd
  from k2jax.convert.export_dir import ExportError, check_destination

  src, dst = FLAGS.src, FLAGS.dst
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  try:
    check_destination(dst, src)  # before the (long) load: fail fast, touch nothing
  except ExportError as e:
    sys.exit(f"convert: {e}")
  if wd.is_workdir(src):
    k2jax.save_hf(k2jax.load(src), dst, dtype=FLAGS.dtype, tokenizer_from=src)
    print(f"wrote HF directory {dst}")
  elif os.path.isfile(os.path.join(src, "config.json")):
    try:
      _hf_to_workdir(src, dst)
    except ExportError as e:  # dst changed while we were loading
      sys.exit(f"convert: {e}")
    print(f"wrote k2jax workdir {dst}")
  else:
    raise app.UsageError(f"--src={src}: neither a k2jax workdir ({wd.MODEL_CONFIG}) nor an HF directory (config.json)")


def _hf_to_workdir(src: str, dst: str) -> None:
  """Every process: read its own slices of the HF directory onto the mesh, write its own orbax shards."""
  import jax
  from flax import nnx

  from k2jax import sharding
  from k2jax.api import source_state
  from k2jax.convert import hf as hf_io
  from k2jax.convert import workdir as wd
  from k2jax.convert.safetensors_io import STATS
  from k2jax.model.transformer import K2Model

  cfg = hf_io.read_config(src, **({"param_dtype": FLAGS.dtype} if FLAGS.dtype else {}))
  shape = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.mesh.split(",") if kv)}
  mesh = sharding.make_mesh(shape)
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  shardings = nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, FLAGS.rules))
  state = source_state(src, cfg, shardings, read_budget_bytes=FLAGS.read_budget_bytes)
  total = sum(os.path.getsize(os.path.join(src, f)) for f in set(hf_io.weight_map(src).values()))
  print(f"process {jax.process_index()}: read {STATS.data_bytes} of {total} shard bytes", flush=True)
  wd.save_model_only(cfg, state, dst)


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "dst"])
  app.run(main)
