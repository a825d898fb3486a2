"""Host-side metrics pieces: the spike detector, metrics.jsonl truncation on resume, records."""

import json

import numpy as np

from k2jax.train.metrics import SpikeDetector, to_record, truncate_after


def test_spike_detector_flags_jumps_and_keeps_its_baseline():
  d = SpikeDetector(factor=2.0, window=3)
  assert [d.check(x) for x in (4.0, 4.2, 3.8)] == [False, False, False]  # filling the window
  assert d.check(9.0)  # > 2 x mean(4.0, 4.2, 3.8)
  assert d.state() == [4.0, 4.2, 3.8]  # the spike does not enter the baseline
  assert not d.check(float("nan"))  # non-finite losses are counted as skips, not spikes
  assert not d.check(4.1) and d.state() == [4.2, 3.8, 4.1]
  assert SpikeDetector(2.0, 3, d.state()).check(9.0)  # restored from a checkpoint's meta


def test_truncate_after_drops_steps_past_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
  truncate_after(str(path), 4)
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_record_types():
  rec = to_record(
    3,
    {
      "loss": np.float32(2.5),
      "skipped_steps": np.int32(1),
      "finite": np.bool_(True),
      "max_attn_logit_per_layer": np.array([1.0, 2.0], np.float32),
    },
    tokens_per_sec=10.0,
    mfu=0.5,
  )
  assert rec == {
    "step": 3,
    "loss": 2.5,
    "skipped_steps": 1,
    "max_attn_logit_per_layer": [1.0, 2.0],
    "tokens_per_sec": 10.0,
    "mfu": 0.5,
  }
  json.dumps(rec)
