"""Convert between a Hugging Face Kimi-K2 directory and a k2jax workdir (direction from `--src`).

  python launch/convert.py --src=HF_DIR --dst=WORKDIR                     # HF -> k2jax workdir
  python launch/convert.py --src=WORKDIR --dst=HF_DIR [--dtype=bfloat16|fp8|int4]  # k2jax -> HF safetensors

HF -> WORKDIR runs on any number of processes (--coordinator_address/--num_processes/--process_id, or
the cluster's own environment on a TPU pod): the model is laid out over all devices (--mesh, --rules),
each process reads only the byte ranges of its own slices (`k2jax.convert.reader`; the release's
block-FP8 and the INT4 release's packed experts are dequantized on the way, into --dtype or the source's
dtype; float32 keeps INT4 codes exact, so a later int4 export re-quantizes to the same bytes) and writes its own orbax
shards; process 0 swaps the workdir into place. --dst must be on a filesystem every process shares.

WORKDIR -> HF runs the same way: the latest checkpoint is restored over all devices, each process writes
the HF tensors its devices hold (`k2jax.convert.writer`) and process 0 the index, config.json and
tokenizer, then swaps the export into place. --dtype=fp8 writes the release's block-FP8 layout (what
SGLang and vLLM serve): F8_E4M3 projections with float32 128x128 `weight_scale_inv`, bf16 embeddings,
lm_head, norms and router, float32 router bias. --dtype=int4 writes Kimi-K2-Thinking's layout: the routed
experts as compressed-tensors pack-quantized int4 (group 32, bf16 scale amax/7, the grid `expert_qat='int4'`
trains on), everything else bf16 and listed in quantization_config's `ignore`.

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
flags.DEFINE_enum(
  "dtype",
  None,
  ["float32", "bfloat16", "fp8", "int4"],
  "Weight dtype written (default: the source's; fp8, int4: HF exports).",
)
flags.DEFINE_string("mesh", "fsdp=-1", "Mesh axes, e.g. 'fsdp=-1' or 'fsdp=64,expert=8'.")
flags.DEFINE_string("rules", "fsdp", "k2jax.sharding rules preset (fsdp | fsdp_ep | fsdp_ep_tp).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (else K2JAX_COORDINATOR or the cluster).")
flags.DEFINE_integer("num_processes", None, "Total JAX processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's index (multi-host).")
flags.DEFINE_integer("read_budget_bytes", 2 << 30, "HF -> WORKDIR: host bytes of HF blocks in flight per process.")
flags.DEFINE_integer(
  "threads", 0, "Host threads reading/converting (HF -> WORKDIR) or quantizing (-> HF) per process; 0: two per core."
)
flags.DEFINE_string(
  "tokenizer_from", None, "WORKDIR -> HF: directory whose tiktoken.model the export carries (default: --src)."
)
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  from k2jax import distributed
  from k2jax.convert import workdir as wd
  from k2jax.convert.export_dir import ExportError, check_destination

  src, dst = FLAGS.src, FLAGS.dst
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  try:
    check_destination(dst, src)  # before the (long) load: fail fast, touch nothing
  except ExportError as e:
    sys.exit(f"convert: {e}")
  if FLAGS.dtype in ("fp8", "int4") and not wd.is_workdir(src):
    raise app.UsageError(
      f"--dtype={FLAGS.dtype} is an export format (WORKDIR -> HF); an HF source is read as it is stored"
    )
  if wd.is_workdir(src):
    try:
      _workdir_to_hf(src, dst)
    except ExportError as e:  # dst changed while we were restoring
      sys.exit(f"convert: {e}")
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

  from k2jax.convert import hf as hf_io
  from k2jax.convert import workdir as wd
  from k2jax.convert.safetensors_io import STATS

  cfg = hf_io.read_config(src, **({"param_dtype": FLAGS.dtype} if FLAGS.dtype else {}))
  shardings = _shardings(cfg)
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), hf_io.abstract_state(cfg), shardings
  )
  state = hf_io.read_state(src, cfg, abstract, read_budget_bytes=FLAGS.read_budget_bytes, threads=FLAGS.threads)
  total = sum(os.path.getsize(os.path.join(src, f)) for f in set(hf_io.weight_map(src).values()))
  print(f"process {jax.process_index()}: read {STATS.data_bytes} of {total} shard bytes", flush=True)
  wd.save_model_only(cfg, state, dst)


def _workdir_to_hf(src: str, dst: str) -> None:
  """Every process: restore the latest checkpoint over the mesh, write the HF tensors it holds."""
  from k2jax.api import source_config, source_state
  from k2jax.convert import writer
  from k2jax.convert.tokenizer import export_tokenizer

  cfg = source_config(src)
  state = source_state(src, cfg, _shardings(cfg))
  tokenizer = lambda tmp: export_tokenizer(tmp, cfg.vocab_size, src=FLAGS.tokenizer_from or src)  # noqa: E731
  writer.save_hf(cfg, state, dst, dtype=FLAGS.dtype, write_extra=tokenizer, threads=FLAGS.threads)


def _shardings(cfg):
  """The model's param shardings over all devices (--mesh, --rules), as a pure dict."""
  from flax import nnx

  from k2jax import sharding
  from k2jax.model.transformer import K2Model

  shape = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.mesh.split(",") if kv)}
  mesh = sharding.make_mesh(shape)
  abstract = nnx.state(nnx.eval_shape(lambda: K2Model(cfg, rngs=nnx.Rngs(0))))
  return nnx.to_pure_dict(sharding.param_shardings(abstract, mesh, FLAGS.rules))


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "dst"])
  app.run(main)
