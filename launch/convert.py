"""Convert between a Hugging Face Kimi-K2 directory and a k2jax workdir (direction from `--src`).

  python launch/convert.py --src=HF_DIR --dst=WORKDIR                     # HF -> k2jax workdir
  python launch/convert.py --src=WORKDIR --dst=HF_DIR [--dtype=bfloat16]  # k2jax -> HF safetensors

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
FLAGS = flags.FLAGS


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file at INFO
  import k2jax
  from k2jax.convert import hf as hf_io
  from k2jax.convert import workdir as wd
  from k2jax.convert.export_dir import ExportError, check_destination

  src, dst = FLAGS.src, FLAGS.dst
  try:
    check_destination(dst, src)  # before the (long) load: fail fast, touch nothing
  except ExportError as e:
    sys.exit(f"convert: {e}")
  if wd.is_workdir(src):
    k2jax.save_hf(k2jax.load(src), dst, dtype=FLAGS.dtype, tokenizer_from=src)
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


if __name__ == "__main__":
  flags.mark_flags_as_required(["src", "dst"])
  app.run(main)
