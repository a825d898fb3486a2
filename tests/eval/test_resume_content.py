"""What a rerun may reuse: a stored sample only when the model's content, the data files' content and the
grader's version match (a checkpoint rewritten at the same path, an edited task file or a new grader refuse,
naming what changed); maj@k over the format's answer equivalence; a k above n refused before any work."""

import dataclasses
import hashlib
import json
import os
import socket
from fractions import Fraction
from pathlib import Path

import pytest

from k2jax.eval import EvalConfig, TaskSpec, run, tasks
from k2jax.eval import runner as runner_lib
from k2jax.eval.runner import check_tasks
from k2jax.eval.store import CONTENT_CACHE, ContentHasher

from .conftest import GSM8K, MC, scripted_model, write_jsonl
from .test_runner import respond


def _hf_dir(tmp_path, weights=b"\x01" * 4096):
  d = tmp_path / "ckpt"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text('{"model_type": "kimi_k2"}')
  (d / "model.safetensors").write_bytes(weights)
  (d / ".cache").mkdir(exist_ok=True)
  (d / ".cache" / "download.lock").write_text("hub bookkeeping")  # hidden: not the model
  return d


def _config(tmp_path, model, **kw):
  data = tmp_path / "data"
  data.mkdir(exist_ok=True)
  path = data / "gsm8k.jsonl"
  if not path.exists():
    write_jsonl(path, GSM8K)
  spec = TaskSpec("gsm", str(path), "gsm8k")
  base = {"model": str(model), "tasks": (spec,), "out": str(tmp_path / "out"), "n": 2, "ks": (1, 2)}
  return EvalConfig(**{**base, "temperature": 0.7, "progress": False, **kw})


def test_a_checkpoint_rewritten_at_the_same_path_refuses_the_stale_samples(tmp_path, tok):
  ckpt = _hf_dir(tmp_path)
  config = _config(tmp_path, ckpt)
  model, engine = scripted_model(tok, respond)
  report = run(config, model)
  assert len(engine.calls) == 6
  want = hashlib.sha256()
  for rel, body in (("config.json", b'{"model_type": "kimi_k2"}'), ("model.safetensors", b"\x01" * 4096)):
    want.update(f"{rel}\0{len(body)}\0{hashlib.sha256(body).hexdigest()}\n".encode())
  assert report["model"]["fingerprint"] == want.hexdigest()
  assert report["model"]["source"] == "content of 2 files, 4121 bytes"
  # The same content (a rerun, or the hub's bookkeeping changing) reuses every sample.
  (ckpt / ".cache" / "download.lock").write_text("touched")
  again, engine = scripted_model(tok, respond)
  run(config, again)
  assert engine.calls == []
  # New weights at the same path and of the same size: the old samples are not this model's.
  (ckpt / "model.safetensors").write_bytes(b"\x02" * 4096)
  stale, engine = scripted_model(tok, respond)
  with pytest.raises(ValueError, match="made with other settings: the model's content .* changed.*fresh --out"):
    run(config, stale)
  assert engine.calls == []


def _workdir(tmp_path, step, body):
  w = tmp_path / "wd"
  (w / "checkpoints" / str(step) / "model" / "d").mkdir(parents=True)
  (w / "model_config.json").write_text('{"num_hidden_layers": 2}')
  (w / "checkpoints" / str(step) / "model" / "d" / "shard").write_bytes(body)
  (w / "checkpoints" / str(step) / "optimizer").mkdir()
  (w / "checkpoints" / str(step) / "optimizer" / "mu").write_bytes(b"optimizer state: not the model")
  return w


def test_a_workdir_is_its_latest_checkpoints_model_item(tmp_path, tok):
  w = _workdir(tmp_path, 3, b"step three")
  config = _config(tmp_path, w)
  model, _ = scripted_model(tok, respond)
  first = run(config, model)["model"]
  assert first["source"] == "content of 2 files, 34 bytes"  # model_config.json (24) + the model item's shard (10)
  # Training goes on logging in the workdir, and an unfinished step (orbax's tmp dir) appears: same model.
  (w / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
  (w / "checkpoints" / "5.orbax-checkpoint-tmp-1").mkdir()
  (w / "checkpoints" / "3" / "optimizer" / "mu").write_bytes(b"other optimizer state")
  again, engine = scripted_model(tok, respond)
  assert run(config, again)["model"]["fingerprint"] == first["fingerprint"] and engine.calls == []
  # A finished later step is another model.
  (w / "checkpoints" / "5" / "model").mkdir(parents=True)
  (w / "checkpoints" / "5" / "model" / "shard").write_bytes(b"step five")
  later, engine = scripted_model(tok, respond)
  with pytest.raises(ValueError, match="the model's content"):
    run(config, later)
  empty = tmp_path / "empty" / "wd"
  empty.mkdir(parents=True)
  (empty / "model_config.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match="no checkpoint found"):
    run(_config(tmp_path / "empty", empty), scripted_model(tok, respond)[0])


def test_an_edited_task_file_or_a_new_grader_refuses_the_stale_samples(tmp_path, tok, monkeypatch):
  config = _config(tmp_path, _hf_dir(tmp_path))
  model, _ = scripted_model(tok, respond)
  report = run(config, model)
  data = report["tasks"]["gsm"]["data"]
  assert data["sha256"] == hashlib.sha256(Path(config.tasks[0].path).read_bytes()).hexdigest()
  assert report["tasks"]["gsm"]["fingerprint"]["grader"] == "gsm8k/1" and report["tasks"]["gsm"]["version"] == "1"
  # One question edited in place (same path, same doc ids): every stored sample of the task is suspect.
  rows = [dict(GSM8K[0], question=GSM8K[0]["question"].replace("4 more", "5 more")), *GSM8K[1:]]
  write_jsonl(tmp_path / "data" / "gsm8k.jsonl", rows)
  with pytest.raises(ValueError, match="the task's data file .* content"):
    run(config, scripted_model(tok, respond)[0])
  write_jsonl(tmp_path / "data" / "gsm8k.jsonl", GSM8K)  # the original bytes again: reused
  model, engine = scripted_model(tok, respond)
  run(config, model)
  assert engine.calls == []
  # A new grader version (a fixed grader) never reuses the old verdicts.
  new = dataclasses.replace(tasks.get_format("gsm8k"), version="2")
  monkeypatch.setitem(tasks._FORMATS, "gsm8k", new)
  with pytest.raises(ValueError, match=r"the grader / format version \(grader gsm8k/1 then, gsm8k/2 now\)"):
    run(config, scripted_model(tok, respond)[0])


def test_samples_from_before_content_fingerprints_are_refused(tmp_path, tok):
  config = _config(tmp_path, _hf_dir(tmp_path))
  os.makedirs(config.out)
  old = {"task": "gsm", "doc_id": "0", "sample": 0, "fingerprint": "0123456789abcdef", "score": 1.0, "answer": "7"}
  (tmp_path / "out" / "samples.jsonl").write_text(json.dumps(old) + "\n")
  with pytest.raises(ValueError, match="a fingerprint without parts .*before content fingerprints"):
    run(config, scripted_model(tok, respond)[0])


def test_the_content_cache_rehashes_only_changed_files(tmp_path):
  big = tmp_path / "w.bin"
  big.write_bytes(b"a" * 5000)
  hasher = ContentHasher(str(tmp_path / "out"), small_file=1000)
  assert hasher.file(str(big)) == hashlib.sha256(b"a" * 5000).hexdigest() and hasher.hashed_bytes == 5000
  hasher.save()
  cached = json.loads((tmp_path / "out" / CONTENT_CACHE).read_text())[os.path.realpath(big)]
  assert cached["size"] == 5000 and cached["sha256"] == hashlib.sha256(b"a" * 5000).hexdigest()
  again = ContentHasher(str(tmp_path / "out"), small_file=1000)
  assert again.file(str(big)) == cached["sha256"] and again.hashed_bytes == 0  # read from the cache
  big.write_bytes(b"b" * 5000)  # rewritten in place: size equal, mtime/ctime not
  st = os.stat(big)
  os.utime(big, ns=(st.st_atime_ns, cached["mtime_ns"]))  # even with the old mtime put back, ctime moved
  assert again.file(str(big)) == hashlib.sha256(b"b" * 5000).hexdigest() and again.hashed_bytes == 5000
  small = tmp_path / "config.json"
  small.write_text("{}")
  assert again.file(str(small)) == hashlib.sha256(b"{}").hexdigest() and str(small) not in json.dumps(again.cache)


def test_a_url_is_fingerprinted_by_what_its_server_reports(tmp_path):
  from .test_http import _fake_server

  fps = []
  for version in ("3", "4"):
    info = {"model_path": "/models/k2", "weight_version": version, "model_type": "kimi_k2", "tokenizer_path": "x"}
    httpd, url = _fake_server(info)
    try:
      config = _config(tmp_path, url, tokenizer="bundled")
      model = runner_lib.open_model(config)
      assert model.identity == {
        "model_path": "/models/k2",
        "weight_version": version,
        "model_type": "kimi_k2",
        "architectures": None,
        "served_model_name": None,
      }
      fp = runner_lib._model_fingerprint(url, model, ContentHasher(str(tmp_path / "out")))
      model.engine.close()
    finally:
      httpd.shutdown()
    assert fp["url"] == url and fp["server"]["weight_version"] == version
    fps.append(fp["fingerprint"])
  assert fps[0] != fps[1]  # a weight update on the server is another model


def test_maj_at_k_votes_over_the_formats_equivalence(tmp_path, tok, monkeypatch):
  """answer.exact graded by the RL exact reward ("1/2" is wrong against "0.5"); with the format's `same` as
  numeric equality, 0.5, 1/2 and 2/4 are one answer that outvotes "3" twice, graded by its first sample."""
  path = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "Half of one?", "answer": "0.5"}])
  said = ["3", "0.5", "1/2", "3", "2/4"]
  seeds = {runner_lib._seed(0, "half", "0", i): a for i, a in enumerate(said)}
  config = EvalConfig(
    model="scripted", tasks=(TaskSpec("half", path, "answer.exact"),), out=str(tmp_path / "strings"), n=5,
    ks=(1, 5), temperature=0.7, progress=False,
  )  # fmt: skip
  by_strings = run(config, scripted_model(tok, lambda prompt, seed: seeds[seed])[0])["tasks"]["half"]
  assert [s["score"] for s in by_strings["docs"][0]["samples"]] == [0.0, 1.0, 0.0, 0.0, 0.0]
  assert by_strings["metrics"]["maj@5"] == 0.0 and by_strings["metrics"]["pass@5"] == 1.0
  fmt = tasks.get_format("answer.exact")
  monkeypatch.setitem(
    tasks._FORMATS, "answer.exact", dataclasses.replace(fmt, same=lambda a, b: Fraction(a) == Fraction(b))
  )
  config = dataclasses.replace(config, out=str(tmp_path / "classes"))
  by_classes = run(config, scripted_model(tok, lambda prompt, seed: seeds[seed])[0])["tasks"]["half"]
  assert by_classes["metrics"]["maj@5"] == 1.0 and by_classes["metrics"]["maj@1"] == 0.0


def test_a_k_above_n_is_refused_before_the_model_is_opened(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"  # would fail as unreachable if it were opened
  config = _config(tmp_path, url, n=4, ks=(1, 8))
  with pytest.raises(ValueError, match=r"task 'gsm': k=8 \(ks=\[1, 8\]\) is above its n=4 samples per problem"):
    run(config)
  with pytest.raises(ValueError, match="task 'gsm': k=8"):
    check_tasks(config)  # RL's and SFT's eval tasks are checked at start the same way
  assert not os.path.exists(config.out)
  # A task's own n below the run's ks names that task; multiple choice has no k and is not refused.
  mc = TaskSpec("mc", write_jsonl(tmp_path / "mc.jsonl", MC), "mc")
  spec = dataclasses.replace(config.tasks[0], name="few", n=2, ks=None)
  with pytest.raises(ValueError, match=r"task 'few': k=4 \(ks=\[1, 4\]\) is above its n=2"):
    check_tasks(dataclasses.replace(config, tasks=(mc, spec), ks=(1, 4)))
  check_tasks(dataclasses.replace(config, tasks=(mc,), n=1, temperature=0.0, ks=(1, 4)))
