"""Host-side metrics pieces: the spike detector, metrics.jsonl truncation on resume, records."""

import json
import logging

import numpy as np
import pytest

from k2jax.train.metrics import MetricsFileError, SpikeDetector, to_record, truncate_after


def _lines(steps):
  return "".join(json.dumps({"loss": 1.0, "step": s}, sort_keys=True) + "\n" for s in steps)


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


@pytest.mark.parametrize(
  "tail",
  [
    b'{"loss": 1.0, "st',  # partial JSON, no newline (the disk filled mid-write)
    b"\x00" * 300,  # the file grew but its data never reached the disk (power loss)
    b'{"loss": 1.0, "step": 8}\x00\x00',  # a whole record then NULs, no newline
    b'{"lo\xc3',  # cut inside a UTF-8 sequence
  ],
)
def test_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog, tail):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(_lines(range(1, 8)).encode() + tail)
  with caplog.at_level(logging.WARNING):
    truncate_after(str(path), 4)
  assert f"{path}:8: dropped a torn last line" in caplog.text
  assert path.read_text() == _lines(range(1, 5))  # kept lines byte for byte, newline-terminated
  path.write_bytes(_lines(range(1, 4)).encode() + tail)  # the torn line is the resumed step's own record
  truncate_after(str(path), 4)
  assert path.read_text() == _lines(range(1, 4))
  with open(path, "a") as f:  # what the logger appends next parses
    f.write(_lines([5]))
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3, 5]


def test_complete_last_line_without_newline_is_kept(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(_lines(range(1, 4)).rstrip("\n"))
  truncate_after(str(path), 4)
  assert path.read_text() == _lines(range(1, 4))


def test_damaged_middle_line_is_an_error_unless_it_would_be_dropped_anyway(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  body = _lines(range(1, 3)) + '{"loss": 1.0, "st\n' + _lines(range(3, 8))
  path.write_text(body)
  with pytest.raises(MetricsFileError, match=rf"{path}:3: not a metrics record .*not the last line"):
    truncate_after(str(path), 4)  # line 3 may hold step 2..3, which the resume keeps
  assert path.read_text() == body  # refused: nothing rewritten
  path.write_text(_lines(range(1, 6)) + "\x00" * 64 + "\n" + _lines(range(6, 8)))
  with caplog.at_level(logging.WARNING):
    truncate_after(str(path), 4)  # line 6 follows step 5 > 4: its record is re-run anyway
  assert f"{path}:6: dropped a damaged line among those logged after step 4" in caplog.text
  assert path.read_text() == _lines(range(1, 5))


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
