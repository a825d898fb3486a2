"""Exports replace only what k2jax wrote, atomically; loading rejects layer mismatches and path escapes."""

import json
import logging
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))
import hf_golden  # noqa: E402

import k2jax  # noqa: E402
from k2jax.convert import export_dir  # noqa: E402
from k2jax.convert import hf as hf_io  # noqa: E402
from k2jax.convert import workdir as wd  # noqa: E402
from k2jax.convert.export_dir import ExportError, check_destination  # noqa: E402
from k2jax.convert.hf import CheckpointError  # noqa: E402
from k2jax.model import K2Config, presets  # noqa: E402

CFG = hf_golden.CONFIGS["plain_rope"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _numpy_state(seed, num_hidden_layers=2):
  """A pure state dict of numpy arrays for the tiny preset (no model build, no jax computation)."""
  cfg = presets.get("tiny", num_hidden_layers=num_hidden_layers)
  rng = np.random.default_rng(seed)
  abstract = hf_io.abstract_state(cfg)
  import jax

  return cfg, jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)


def _tree(path):
  out = {}
  for d, _, names in os.walk(path):
    for n in names:
      p = os.path.join(d, n)
      with open(p, "rb") as f:
        out[os.path.relpath(p, path)] = f.read()
  return out


def test_foreign_nonempty_destination_is_refused_and_untouched(tmp_path):
  cfg, state = _numpy_state(0)
  dst = tmp_path / "mine"
  (dst / "notes").mkdir(parents=True)
  (dst / "notes" / "todo.txt").write_text("keep me")
  (dst / "config.json").write_text('{"mine": true}')
  before = _tree(dst)
  with pytest.raises(ExportError, match="not empty and not .only. a k2jax export"):
    hf_io.save_hf(cfg, state, str(dst))
  with pytest.raises(ExportError, match="refusing to replace"):
    wd.save_model_only(cfg, state, str(dst))
  assert _tree(dst) == before and sorted(os.listdir(tmp_path)) == ["mine"]  # no temp dirs left either
  (tmp_path / "file").write_text("x")
  with pytest.raises(ExportError, match="not a directory"):
    hf_io.save_hf(cfg, state, str(tmp_path / "file"))


def test_destination_containing_the_source_is_refused(tmp_path):
  src = tmp_path / "out" / "ckpt"
  src.mkdir(parents=True)
  for dst in (tmp_path / "out", tmp_path, src, tmp_path / "out" / "." / "ckpt" / ".."):
    with pytest.raises(ExportError, match="contains --src"):
      check_destination(str(dst), str(src))
  check_destination(str(src / "hf"), str(src))  # exporting into the source (W/hf) is fine
  check_destination(str(tmp_path / "other"), str(src))


def test_reexport_replaces_only_an_unchanged_export(tmp_path):
  cfg, a = _numpy_state(0)
  _, b = _numpy_state(1)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf, max_shard_bytes=200_000)
  hf_io.save_hf(cfg, b, hf)  # ours: replaced (fewer shards now, none of the old left behind)
  assert sorted(os.listdir(hf)) == sorted(
    [".k2jax-export", "config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"]
  )
  _, got = hf_io.load_hf(hf)
  np.testing.assert_array_equal(got["embed"]["embedding"], b["embed"]["embedding"])
  with open(os.path.join(hf, "README.md"), "w") as f:
    f.write("someone's notes")
  with pytest.raises(ExportError, match="files k2jax did not write: README.md"):
    hf_io.save_hf(cfg, a, hf)
  # A converted workdir that training has since written to is no longer an export to replace.
  w = str(tmp_path / "w")
  wd.save_model_only(cfg, a, w)
  wd.save_model_only(cfg, b, w)
  os.makedirs(os.path.join(w, "checkpoints", "100"))
  with open(os.path.join(w, "checkpoints", "100", "commit_success.txt"), "w") as f:
    f.write("step 100")
  with pytest.raises(ExportError, match="checkpoints/100/commit_success.txt"):
    wd.save_model_only(cfg, a, w)
  assert os.path.isfile(os.path.join(w, "checkpoints", "100", "commit_success.txt"))


def _expect_refused(tmp_path, hf, before, new_state):
  """The swap was refused: `hf` holds the old export plus the user's file, the new one is complete beside it."""
  assert _tree(hf) == before
  (new,) = [n for n in os.listdir(tmp_path) if n != "hf"]  # no hidden temp or old siblings either
  assert new.startswith("hf.k2jax-new.")
  assert export_dir.is_export(str(tmp_path / new))
  _, got = hf_io.load_hf(str(tmp_path / new))
  np.testing.assert_array_equal(got["embed"]["embedding"], new_state["embed"]["embedding"])
  return str(tmp_path / new)


@pytest.mark.parametrize("when", ["while_writing", "before_exchange", "before_two_renames"])
def test_a_file_written_into_the_old_export_during_an_export_is_never_deleted(tmp_path, monkeypatch, when):
  """A user's file lands in the old export while the new one is written (or in the instant before the
  swap): the swap is refused naming it, nothing is replaced or deleted, and the new export is kept."""
  cfg, a = _numpy_state(0)
  _, b = _numpy_state(1)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf)

  def user_writes():
    with open(os.path.join(hf, "NOTES.md"), "w") as f:
      f.write("my eval results")

  if when == "while_writing":  # the new export's files are written, its swap not yet checked
    real_fsync = export_dir._fsync_tree
    monkeypatch.setattr(export_dir, "_fsync_tree", lambda root: (user_writes(), real_fsync(root)))
  else:  # after the pre-swap check: the exchange (or the first of two renames) moves the file out of hf
    real_exchange = export_dir._exchange
    calls = []

    def exchange(x, y):
      if not calls:
        user_writes()
      calls.append((x, y))
      return real_exchange(x, y) if when == "before_exchange" else False

    monkeypatch.setattr(export_dir, "_foreign", _after_first_check(export_dir._foreign))
    monkeypatch.setattr(export_dir, "_exchange", exchange)
  with pytest.raises(ExportError, match=r"hf: files k2jax did not write appeared there while the export ran: NOTES.md"):
    hf_io.save_hf(cfg, b, hf)
  user_writes()  # what hf held before the refused swap (the old export and the note)
  before = _tree(hf)
  new = _expect_refused(tmp_path, hf, before, b)
  _, got = hf_io.load_hf(hf)
  np.testing.assert_array_equal(got["embed"]["embedding"], a["embed"]["embedding"])
  # The user moves their note out: the next export replaces the old one.
  monkeypatch.undo()
  os.rename(os.path.join(hf, "NOTES.md"), str(tmp_path / "NOTES.md"))
  hf_io.save_hf(cfg, b, hf)
  assert sorted(os.listdir(tmp_path)) == sorted(["hf", os.path.basename(new), "NOTES.md"])


def _after_first_check(real):
  """`_foreign` that sees nothing foreign on its first call (the pre-swap check ran before the user wrote)."""
  seen = []

  def foreign(path):
    seen.append(path)
    return [] if len(seen) == 1 else real(path)

  return foreign


def test_a_file_left_in_the_swapped_out_export_is_kept(tmp_path, monkeypatch, caplog):
  """A file that reaches the old export after the swap's checks (through a handle opened inside it) is
  not deleted with it: the rest goes, that file is kept beside the new export, with a warning."""
  cfg, a = _numpy_state(0)
  _, b = _numpy_state(1)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf)
  real_remove = export_dir.remove_export

  def remove(path, dst):
    os.makedirs(os.path.join(path, "runs"))
    with open(os.path.join(path, "runs", "log.txt"), "w") as f:
      f.write("written through an open handle")
    real_remove(path, dst)

  monkeypatch.setattr(export_dir, "remove_export", remove)
  with caplog.at_level(logging.WARNING):
    hf_io.save_hf(cfg, b, hf)
  _, got = hf_io.load_hf(hf)
  np.testing.assert_array_equal(got["embed"]["embedding"], b["embed"]["embedding"])
  (kept,) = [n for n in os.listdir(tmp_path) if n != "hf"]
  assert kept.startswith("hf.k2jax-kept.")
  assert _tree(tmp_path / kept) == {os.path.join("runs", "log.txt"): b"written through an open handle"}
  assert f"kept them at {tmp_path / kept}" in caplog.text and "runs/log.txt" in caplog.text


def test_a_dead_writers_swapped_out_export_is_cleaned_by_its_list(tmp_path):
  """A writer killed after its swap leaves the old export in its temp sibling: the next write deletes the
  files k2jax wrote and keeps anything else."""
  cfg, a = _numpy_state(0)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf)
  stale = tmp_path / f".k2jax-tmp-hf.{socket.gethostname()}.{_dead_pid()}.0123abcd"
  hf_io.save_hf(cfg, a, str(stale))  # an old export, marker and all
  (stale / "mine.txt").write_text("not k2jax's")
  assert sorted(os.listdir(tmp_path)) == sorted(["hf", stale.name])
  hf_io.save_hf(cfg, a, hf)
  (kept,) = [n for n in os.listdir(tmp_path) if n != "hf"]
  assert kept.startswith("hf.k2jax-kept.") and _tree(tmp_path / kept) == {"mine.txt": b"not k2jax's"}


def test_exports_from_before_the_marker_are_recognised(tmp_path):
  cfg, a = _numpy_state(0)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf)
  os.remove(os.path.join(hf, export_dir.MARKER))
  assert export_dir.is_export(hf)
  hf_io.save_hf(cfg, a, hf)  # marked just before the swap, then deleted by that list: nothing left over
  assert sorted(os.listdir(tmp_path)) == ["hf"] and export_dir.is_export(hf)
  # The same file names with a published (not k2jax-dumped) config.json are someone else's.
  other = str(tmp_path / "published")
  hf_golden.write_hf_dir(other, CFG, hf_golden.random_hf_state(CFG, 0))
  assert not export_dir.is_export(other)
  with pytest.raises(ExportError, match="no .k2jax-export"):
    hf_io.save_hf(cfg, a, other)


def test_modes_are_0755_and_0644_whatever_the_umask(tmp_path):
  cfg, a = _numpy_state(0)
  old = os.umask(0o077)
  try:
    hf_io.save_hf(cfg, a, str(tmp_path / "hf"))
    wd.save_model_only(cfg, a, str(tmp_path / "w"))
  finally:
    os.umask(old)
  for top in ("hf", "w"):
    for d, dirs, names in os.walk(tmp_path / top):
      assert os.stat(d).st_mode & 0o777 == 0o755, d
      for n in names:
        assert os.stat(os.path.join(d, n)).st_mode & 0o777 == 0o644, (d, n)


def _dead_pid():
  p = subprocess.Popen(["true"])
  p.wait()
  return p.pid


def test_stale_temp_dirs_of_dead_processes_are_cleaned(tmp_path):
  cfg, a = _numpy_state(0)
  host, dead = socket.gethostname(), _dead_pid()
  stale = [f".k2jax-tmp-hf.{host}.{dead}.0123abcd", f".k2jax-old-hf.{host}.{dead}.4567abcd"]
  kept = [
    f".k2jax-tmp-hf.{host}.{os.getpid()}.89abcdef",  # a live writer
    f".k2jax-tmp-hf.other-host.{dead}.0123abcd",  # another machine's writer: cannot tell, leave it
    f".k2jax-tmp-hf2.{host}.{dead}.0123abcd",  # another export's
    "unrelated",
  ]
  hf_io.save_hf(cfg, a, str(tmp_path / "hf"))  # present, so the old sibling is garbage, not a recovery
  for name in stale + kept:
    (tmp_path / name).mkdir()
    (tmp_path / name / "model-00001-of-00001.safetensors").write_text("partial")
  hf_io.save_hf(cfg, a, str(tmp_path / "hf"))
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["hf"])


def test_interrupted_swap_without_exchange_is_recovered_on_load(tmp_path, monkeypatch):
  """Filesystems without RENAME_EXCHANGE swap with two renames; a death between them is undone on load."""
  cfg, a = _numpy_state(0)
  _, b = _numpy_state(1)
  hf = str(tmp_path / "hf")
  hf_io.save_hf(cfg, a, hf)
  monkeypatch.setattr(export_dir, "_exchange", lambda x, y: False)
  hf_io.save_hf(cfg, b, hf)  # the fallback path itself
  np.testing.assert_array_equal(hf_io.load_hf(hf)[1]["embed"]["embedding"], b["embed"]["embedding"])
  os.rename(hf, str(tmp_path / f".k2jax-old-hf.{socket.gethostname()}.{_dead_pid()}.0123abcd"))
  model = k2jax.load(hf)  # finds the old export beside the missing one and puts it back
  np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), b["embed"]["embedding"])
  assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_sigkill_at_every_point_of_a_reexport_leaves_old_or_new_and_nothing_beside(tmp_path):
  """A re-export killed at each of its filesystem changes, in each swap mode (reexport_kill_worker.py): the
  destination holds the old export or the new one, and the next export leaves nothing beside it: no temp or
  old sibling, and no `.k2jax-kept.*` (k2jax's own export never looks foreign; it did once an empty MARKER
  was left by a kill between its open and its close)."""
  dst = str(tmp_path / "hf")
  p = subprocess.run(
    [sys.executable, os.path.join(ROOT, "tests", "convert", "reexport_kill_worker.py"), ROOT, dst],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert set(out) == {"exchange", "two_renames", "before_marker"}, out
  for mode, rows in out.items():
    *killed, last = rows
    assert len(killed) >= {"exchange": 20, "two_renames": 6, "before_marker": 6}[mode], (mode, rows)  # hooks fired
    assert [r[0] for r in killed] == list(range(1, len(killed) + 1)), (mode, rows)
    assert {r[1] for r in killed} == {"a", "b"}, (mode, rows)  # killed before the swap and after it
    assert [r for r in killed if r[1] not in ("a", "b") or r[2] != ["hf"]] == [], (mode, rows)
    assert last[1:] == ["b", ["hf"], 0], (mode, last)  # the first writer it did not kill exported "b"
  model = k2jax.load(dst)  # and the final export is a loadable model
  assert model.cfg.num_hidden_layers == 2


def test_shards_holding_layers_config_json_does_not_describe(tmp_path):
  three = dict(CFG, num_hidden_layers=3)
  path = str(tmp_path / "hf")
  hf_golden.write_hf_dir(path, three, hf_golden.random_hf_state(three, 0))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(CFG, f)  # says 2 layers; the shards hold 3
  with pytest.raises(CheckpointError, match=r"tensors \(of layers \[2\]\) are not described by config.json.*"):
    k2jax.load(path)
  with pytest.raises(CheckpointError, match="'model.layers.2.input_layernorm.weight'"):
    k2jax.load(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(CFG, num_nextn_predict_layers=1), f)  # the third layer declared as MTP: skipped
  assert k2jax.load(path).cfg.num_hidden_layers == 2
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(CFG, num_hidden_layers=1, num_nextn_predict_layers=1), f)  # MTP is layer 1; 2 is extra
  with pytest.raises(CheckpointError, match=r"of layers \[2\]"):
    k2jax.load(path)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "a/../../x", "", "./x", "a\\..\\x"])
def test_index_paths_must_stay_inside_the_directory(tmp_path, shard):
  path = str(tmp_path / "hf")
  hf_golden.write_hf_dir(path, CFG, hf_golden.random_hf_state(CFG, 0))
  (tmp_path / "outside.safetensors").write_text("not a shard")
  idx = os.path.join(path, "model.safetensors.index.json")
  with open(idx) as f:
    index = json.load(f)
  index["weight_map"]["model.norm.weight"] = shard
  with open(idx, "w") as f:
    json.dump(index, f)
  with pytest.raises(CheckpointError, match="is not a file inside"):
    k2jax.load(path)
  from k2jax.convert.overlay import overlay_hf_tensors

  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(CheckpointError, match="is not a file inside"):
    overlay_hf_tensors(K2Config.from_hf_dict(CFG), {}, path)
