"""Convert between a Hugging Face Kimi-K2 directory and a k2jax workdir (direction from `--src`).

  python launch/convert.py --src=HF_DIR --dst=WORKDIR                     # HF -> k2jax workdir
  python launch/convert.py --src=WORKDIR --dst=HF_DIR [--dtype=bfloat16|fp8]  # k2jax -> HF safetensors

WORKDIR -> HF runs on any number of processes (flags as launch/train.py, or the cluster's own
environment on a TPU pod): the latest checkpoint is restored sharded over all devices (--mesh,
--rules), each process writes the HF tensors its devices hold and process 0 writes the index,
config.json and tokenizer, then swaps the export into place (`k2jax.convert.writer`). --dst must be on
a filesystem every process shares. --dtype=fp8 writes the release's block-FP8 layout (what SGLang and
vLLM serve): F8_E4M3 projections with float32 128x128 `weight_scale_inv`, bf16 embeddings, lm_head,
norms and router, float32 router bias.

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
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "fp8"], "Weight dtype written (default: the source's).")
flags.DEFINE_string("mesh", "fsdp=-1", "WORKDIR -> HF: mesh axes, e.g. 'fsdp=-1' or 'fsdp=64,expert=8'.")
flags.DEFINE_string("rules", "fsdp", "WORKDIR -> HF: k2jax.sharding rules preset (fsdp | fsdp_ep | fsdp_ep_tp).")
flags.DEFINE_string(
  "tokenizer_from", None, "WORKDIR -> HF: directory whose tiktoken.model the export carries (default: --src)."
)
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR or the cluster).")
flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  from k2jax import distributed
  from k2jax.convert import hf as hf_io
  from k2jax.convert import workdir as wd
  from k2jax.convert.export_dir import ExportError, check_destination

  src, dst = FLAGS.src, FLAGS.dst
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  try:
    check_destination(dst, src)  # before the (long) load: fail fast, touch nothing
  except ExportError as e:
    sys.exit(f"convert: {e}")
  if FLAGS.dtype == "fp8" and not wd.is_workdir(src):
    raise app.UsageError("--dtype=fp8 is an export format (WORKDIR -> HF); an HF source is read as it is stored")
  if wd.is_workdir(src):
    try:
      _workdir_to_hf(src, dst)
    except ExportError as e:  # dst changed while we were restoring
      sys.exit(f"convert: {e}")
    print(f"wrote HF directory {dst}")
  elif os.path.isfile(os.path.join(src, "config.json")):
    kw = {"param_dtype": FLAGS.dtype} if FLAGS.dtype else {}
    cfg, state = hf_io.load_hf(src, **kw)
    try:
      wd.save_model_only(cfg, state, dst)
    except ExportError as e:  # dst changed while we were loading
      sys.exit(f"convert: {e}")
    print(f"wrote k2jax workdir {dst}")
  else:
    raise app.UsageError(f"--src={src}: neither a k2jax workdir ({wd.MODEL_CONFIG}) nor an HF directory (config.json)")


def _workdir_to_hf(src: str, dst: str) -> None:
  """Every process: restore the latest checkpoint sharded over all devices, write its own tensors."""
  from flax import nnx

  from k2jax import sharding
  from k2jax.api import source_config, source_state
  from k2jax.convert import writer
  from k2jax.convert.tokenizer import export_tokenizer
  from k2jax.model.transformer import K2Model

  cfg = source_config(src)
  shape = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.mesh.split(",") if kv)}
  mesh = sharding.make_mesh(shape)
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  state = source_state(src, cfg, nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, FLAGS.rules)))
  tokenizer = lambda tmp: export_tokenizer(tmp, cfg.vocab_size, src=FLAGS.tokenizer_from or src)  # noqa: E731
  writer.save_hf(cfg, state, dst, dtype=FLAGS.dtype, write_extra=tokenizer)


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "dst"])
  app.run(main)
