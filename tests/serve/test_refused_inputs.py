"""Inputs the server refuses with a 4xx naming the problem, the served weights unchanged: weight updates it
cannot trust (a NUL in the path, a config.json nested too deep, a FIFO or other non-regular file, NaN or
Inf values) and bodies OpenAI's and SGLang's own validation refuse (stream_options of the wrong type, lone
surrogates, chat messages without content)."""

import json
import os
import pathlib
import shutil

import numpy as np
import pytest
import requests
from safetensors.numpy import save_file

from k2jax.convert import hf_dir, safetensors_io
from k2jax.convert.errors import CheckpointError


def _post(served, route, body, status, timeout=60):
  r = requests.post(f"{served.server.url}/{route}", json=body, timeout=timeout)
  assert r.status_code == status, r.text
  return r.json()


def _raw(served, route, raw: bytes, status):
  headers = {"Content-Type": "application/json"}
  r = requests.post(f"{served.server.url}/{route}", data=raw, headers=headers, timeout=60)
  assert r.status_code == status, r.text
  return r.json()


def _greedy(served):
  body = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
  return _post(served, "generate", body, 200)["output_ids"]


@pytest.fixture(scope="module")
def before(served):
  return _greedy(served)


def _refused(served, before, path: str, *needles: str) -> None:
  res = _post(served, "update_weights_from_disk", {"model_path": path}, 400)
  assert res["success"] is False and all(n in res["message"] for n in needles), res
  assert _greedy(served) == before  # the old weights keep serving


def _delta_dir(served, name: str) -> pathlib.Path:
  d = pathlib.Path(served.weights_root) / name
  d.mkdir()
  return d


def _index(d: pathlib.Path, shard: str = "m.safetensors") -> None:
  (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))


# ---- weight updates -----------------------------------------------------------------------------------------
def test_a_model_path_with_a_nul_byte_is_400(served, before):
  _refused(served, before, served.weights_root + "/a\x00b", "NUL byte")


def test_a_config_json_nested_too_deep_is_400(served, before):
  d = _delta_dir(served, "deep_config")
  (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  _refused(served, before, str(d), "config.json", "nested too deeply")


def test_the_reader_refuses_a_deep_config_json_by_name(tmp_path):
  (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(CheckpointError, match="config.json: not valid JSON: nested too deeply"):
    hf_dir.read_config(str(tmp_path))


@pytest.mark.parametrize("what", ["shard", "single", "config", "index"])
def test_a_fifo_is_refused_without_blocking(served, before, what):
  """Every file the update would open, made a FIFO: refused at once (opening one for reading would wait
  for a writer forever, holding a worker thread), the kind named."""
  d = _delta_dir(served, f"fifo_{what}")
  name = {"shard": "m.safetensors", "single": "model.safetensors", "config": "config.json"}.get(what)
  if what == "index":
    os.mkfifo(d / "model.safetensors.index.json")
  else:
    if what == "shard":
      _index(d)
    os.mkfifo(d / name)
  _refused(served, before, str(d), "not a regular file")


def test_a_device_shard_is_refused(tmp_path):
  link = tmp_path / "m.safetensors"
  os.symlink("/dev/zero", link)
  with pytest.raises(CheckpointError, match="character device"):
    safetensors_io.read_header(str(link))


def _lm_head(served, value: float) -> np.ndarray:
  lm = np.asarray(served.model.lm_head.w[...]).T.astype(np.float32).copy()  # HF [S, D]
  lm[5, 3] = value
  return lm


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_delta_holding_nan_or_inf_is_400(served, before, value):
  d = _delta_dir(served, f"nonfinite_{value}")
  save_file({"lm_head.weight": _lm_head(served, value)}, str(d / "m.safetensors"))
  _index(d)
  cols = served.model.cfg.hidden_size
  _refused(served, before, str(d), "'lm_head.weight'", "non-finite", f"flat index {5 * cols + 3}")


def test_a_whole_export_holding_a_nan_is_400(served, before):
  """A full HF directory (config.json and every shard): the NaN is found as its tensor is read."""
  d = pathlib.Path(served.weights_root) / "nan_export"
  shutil.copytree(served.hf_dir, d)
  shard = sorted(d.glob("*.safetensors"))[-1]
  t = sorted(safetensors_io.read_header(str(shard)).values(), key=lambda t: t.key)[0]
  nan = np.array([np.nan], np.float32).astype(t.np_dtype).tobytes()
  with open(shard, "r+b") as f:
    f.seek(t.offset + 2 * len(nan))  # its third element
    f.write(nan)
  _refused(served, before, str(d), repr(t.key), "non-finite", "flat index 2")


def test_the_reader_names_a_non_finite_value_where_it_reads(tmp_path):
  """Each read of a block is checked (a column block too: the gaps between its rows are not)."""
  w = np.arange(24, dtype=np.float32).reshape(4, 6)
  w[2, 4] = np.inf
  path = str(tmp_path / "w.safetensors")
  save_file({"w": w}, path)
  (t,) = safetensors_io.read_header(path).values()
  with safetensors_io.ShardFiles() as files:
    assert np.array_equal(safetensors_io.read_block(files, t, ((0, 4), (0, 3))), w[:, :3])  # no inf in it
    with pytest.raises(CheckpointError, match=r"'w' holds a non-finite value \(inf\) at flat index 16"):
      safetensors_io.read_block(files, t, ((1, 3), (3, 6)))


def _write_shard(path: str, key: str, dtype: str, w: np.ndarray) -> None:
  """A one-tensor safetensors file written by hand (safetensors.numpy has no bf16 or fp8)."""
  data = w.tobytes()
  header = json.dumps({key: {"dtype": dtype, "shape": list(w.shape), "data_offsets": [0, len(data)]}}).encode()
  with open(path, "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header + data)


def _isfinite(w: np.ndarray) -> np.ndarray:
  """The reference: numpy on the values (widened to f64), not on their bits."""
  with np.errstate(invalid="ignore"):
    return np.isfinite(w.astype(np.float64))


@pytest.mark.parametrize("dtype", sorted(safetensors_io.NONFINITE_BITS))
def test_the_finiteness_check_agrees_with_isfinite_for_every_float_dtype(tmp_path, dtype):
  """Every bit pattern of the narrow types (and random ones of the wide) read back: refused exactly when
  np.isfinite finds a non-finite value, at the index it finds."""
  np_dtype = safetensors_io.DTYPES[dtype]
  bits, _ = safetensors_io.NONFINITE_BITS[dtype]
  rng = np.random.default_rng(0)
  if bits.itemsize <= 2:
    every = np.arange(1 << (8 * bits.itemsize), dtype=np.uint64).astype(bits)
  else:
    every = rng.integers(0, np.iinfo(bits).max, 1 << 16, dtype=bits, endpoint=True)
  values = every.view(np_dtype)
  finite = _isfinite(values)
  assert not finite.all()
  path = str(tmp_path / "w.safetensors")
  for w in (values[finite], values):
    _write_shard(path, "w", dtype, w)
    (t,) = safetensors_io.read_header(path).values()
    with safetensors_io.ShardFiles() as files:
      if _isfinite(w).all():
        assert np.array_equal(safetensors_io.read_block(files, t, ((0, w.size),)).view(bits), w.view(bits))
      else:
        first = int(np.argmin(_isfinite(w)))
        with pytest.raises(CheckpointError, match=f"'w' holds a non-finite value .* at flat index {first}$"):
          safetensors_io.read_block(files, t, ((0, w.size),))


# ---- bodies ---------------------------------------------------------------------------------------------------
_CHAT = [{"role": "user", "content": "hi"}]
BAD_BODIES = [
  ("v1/completions", {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
  ("v1/completions", {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
  ("v1/chat/completions", {"messages": _CHAT, "stream": True, "stream_options": [True]}, "stream_options"),
  ("v1/chat/completions", {"messages": _CHAT, "stream": True, "stream_options": {"usage": True}}, "usage"),
  ("v1/chat/completions", {"messages": _CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
  ("v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
  ("v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
  ("v1/chat/completions", {"messages": [*_CHAT, {"role": "assistant", "content": None}]}, "messages[1].content"),
  ("v1/chat/completions", {"messages": [{"role": "system"}, *_CHAT]}, "messages[0].content"),
]


@pytest.mark.parametrize("route,body,field", BAD_BODIES, ids=[f"{r}:{f}:{i}" for i, (r, _, f) in enumerate(BAD_BODIES)])
def test_bodies_openai_refuses_are_400_naming_the_field(served, route, body, field):
  err = _post(served, route, {**body, "max_tokens": 2}, 400)["error"]
  assert field in err["param"] and field.split(".")[-1] in err["message"], err


# A JSON escape of half a surrogate pair decodes to a str no tokenizer can encode.
LONE = [
  ("generate", b'{"text": "ab\\ud800c", "sampling_params": {"max_new_tokens": 1}}', "text"),
  ("generate", b'{"text": ["ok", "\\udfffx"], "sampling_params": {"max_new_tokens": 1}}', "text[1]"),
  (
    "generate",
    b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "stop": ["\\ud83d"]}}',
    "sampling_params.stop[0]",
  ),
  ("v1/completions", b'{"prompt": "x", "max_tokens": 1, "stop": "\\ud83d"}', "stop"),
  ("v1/completions", b'{"prompt": "x\\ud800", "max_tokens": 1}', "prompt"),
  ("v1/completions", b'{"prompt": ["x", "\\ud800"], "max_tokens": 1}', "prompt[1]"),
  ("v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}', "messages[0]"),
  (
    "v1/chat/completions",
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "max_tokens": 1}',
    "messages[0].content",
  ),
  ("tokenize", b'{"prompt": "\\ud800"}', "prompt"),
]


@pytest.mark.parametrize("route,raw,field", LONE, ids=[f"{r}:{f}" for r, _, f in LONE])
def test_lone_surrogates_are_400(served, route, raw, field):
  err = _raw(served, route, raw, 400)["error"]
  assert err["param"].startswith(field) and "lone surrogate" in err["message"], err


def test_a_valid_surrogate_pair_and_an_assistant_tool_call_without_content_are_served(served):
  out = _raw(served, "generate", b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 1}}', 200)
  assert out["meta_info"]["completion_tokens"] == 1
  call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
  messages = [
    *_CHAT,
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
  ]
  assert _post(served, "v1/chat/completions", {"messages": messages, "max_tokens": 1}, 200)["choices"]


def test_stream_options_include_usage_ends_the_stream_with_the_usage(served):
  body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
  body["ignore_eos"] = True
  with requests.post(f"{served.server.url}/v1/completions", json=body, stream=True, timeout=60) as r:
    assert r.status_code == 200
    events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
  assert events[-1] == b"[DONE]"
  last = json.loads(events[-2])
  assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
  assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


def test_a_fifo_header_read_returns_at_once(tmp_path):
  fifo = tmp_path / "f.safetensors"
  os.mkfifo(fifo)
  with pytest.raises(CheckpointError, match="a FIFO"):
    safetensors_io.read_header(str(fifo))
