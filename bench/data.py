"""Data pipeline throughput: tokens/s of the full pretraining pipeline (read + tokenize + pack +
batch) in-process and with 1 and 2 worker processes, against a naive pad-each-document baseline
measured in the same run, on the bundled corpus (repeated) at seq_len 1024.

  python bench/data.py [--batches=200] [--train_tokens_per_sec=20000]

Prints key=value lines; `over_train_consumption` = best pipeline tokens/s over what the tiny train
step consumes (`--train_tokens_per_sec`; 20k/s on the 2-core CI machine unless measured otherwise).
Tokens counted are real (non-padding) tokens delivered to the model.
"""

import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from k2jax.data import PretrainDataConfig, build_pretrain_dataset  # noqa: E402
from k2jax.data.sources import SourceSpec, decode_record, open_source  # noqa: E402
from k2jax.data.tokenizer import load_tokenizer  # noqa: E402

_BATCHES = flags.DEFINE_integer("batches", 200, "Batches timed per configuration.")
_TRAIN_TPS = flags.DEFINE_float("train_tokens_per_sec", 20_000.0, "Tiny train step consumption.")
SEQ_LEN, BATCH = 1024, 8


def time_pipeline(num_workers: int) -> tuple[float, float]:
  """(real tokens/s, non-pad fraction) over _BATCHES batches after a one-batch warmup."""
  cfg = PretrainDataConfig(seq_len=SEQ_LEN, batch_size=BATCH, num_workers=num_workers)
  it = iter(build_pretrain_dataset(cfg, process_index=0, process_count=1))
  next(it)  # Worker start-up and first fill are not steady-state throughput.
  start, real = time.perf_counter(), 0
  for b in itertools.islice(it, _BATCHES.value):
    real += int((b["segment_ids"] > 0).sum())
  elapsed = time.perf_counter() - start
  it.close()
  return real / elapsed, real / (_BATCHES.value * BATCH * SEQ_LEN)


def time_naive() -> tuple[float, float]:
  """Baseline: tokenize each document, cut at seq_len, pad every piece to its own row, batch."""
  tok, ds = load_tokenizer(), open_source(SourceSpec(PretrainDataConfig().sources[0].path))
  rows, real, start, n_rows = [], 0, time.perf_counter(), _BATCHES.value * BATCH
  for i in itertools.cycle(range(len(ds))):
    obj, _ = decode_record(ds[i])
    ids = tok.encode(obj["text"]) + [tok.eos_id]
    for s in range(0, len(ids), SEQ_LEN):
      row = np.zeros(SEQ_LEN, np.int32)
      piece = ids[s : s + SEQ_LEN]
      row[: len(piece)] = piece
      rows.append(row)
      real += len(piece)
    if len(rows) >= n_rows:
      break
  np.stack(rows[:n_rows]).reshape(-1, BATCH, SEQ_LEN)
  return real / (time.perf_counter() - start), real / (len(rows) * SEQ_LEN)


def main(argv):
  del argv
  naive_tps, naive_eff = time_naive()
  results = {w: time_pipeline(w) for w in (0, 1, 2)}
  best = max(tps for tps, _ in results.values())
  for w, (tps, _) in results.items():
    print(f"pipeline_tokens_per_sec_workers{w}={tps:.0f}")
  print(f"naive_pad_tokens_per_sec={naive_tps:.0f}")
  print(f"pipeline_over_naive_tokens_per_sec={results[2][0] / naive_tps:.2f}")
  print(f"naive_packing_efficiency={naive_eff:.4f}")
  print(f"packing_efficiency={results[0][1]:.4f}")
  print(f"train_tokens_per_sec_assumed={_TRAIN_TPS.value:.0f}")
  print(f"over_train_consumption={best / _TRAIN_TPS.value:.1f}")


if __name__ == "__main__":
  app.run(main)
