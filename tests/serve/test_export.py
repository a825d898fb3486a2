"""A k2jax HF export carries its tokenizer: AutoTokenizer loads it offline and k2jax's server answers a
text chat completion from the directory alone."""

import json
import os
import urllib.request

import pytest
from flax import nnx

import k2jax
from k2jax.data.chat import render_chat, render_chat_text
from k2jax.data.tokenizer import load_tokenizer
from k2jax.model import K2Model, presets
from k2jax.engine.inference import EngineConfig
from k2jax.serve import Server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1? Say it, café."}]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  cfg = presets.get("tiny128", num_hidden_layers=2, max_position_embeddings=64)
  assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim == cfg.v_head_dim == 128
  dst = str(tmp_path_factory.mktemp("tiny128_hf"))
  k2jax.save_hf(K2Model(cfg, rngs=nnx.Rngs(0)), dst)
  return dst


def test_export_has_the_kimi_tokenizer_files(export):
  assert {"config.json", "tiktoken.model", "tokenizer_config.json", "tokenizer.json"} <= set(os.listdir(export))
  config = json.load(open(os.path.join(export, "tokenizer_config.json")))
  decoder = config["added_tokens_decoder"]
  assert len(decoder) == 256 and decoder["3842"]["content"] == "<|im_end|>" and decoder["3841"]["content"] == "[EOS]"
  tok = load_tokenizer(os.path.join(export, "tiktoken.model"))  # the Kimi layout reads back
  assert tok.vocab_size == 4096 and tok.special_ids == load_tokenizer().special_ids


def test_reexport_with_the_tokenizer_replaces_the_export(tmp_path):
  """The tokenizer files are part of the atomic export (listed in its marker): exporting again over a
  k2jax export with a tokenizer replaces it instead of refusing a directory with files it did not list."""
  cfg = presets.get("tiny", num_hidden_layers=2, max_position_embeddings=64)
  dst = str(tmp_path / "hf")
  k2jax.save_hf(K2Model(cfg, rngs=nnx.Rngs(0)), dst)
  k2jax.save_hf(K2Model(cfg, rngs=nnx.Rngs(1)), dst)
  assert {"tiktoken.model", "tokenizer_config.json", "tokenizer.json"} <= set(os.listdir(dst))
  with open(os.path.join(dst, ".k2jax-export")) as f:
    assert "tiktoken.model" in f.read()


def test_auto_tokenizer_loads_offline_and_matches_tiktoken(export, monkeypatch):
  transformers = pytest.importorskip("transformers")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  hf = transformers.AutoTokenizer.from_pretrained(export)
  tok = load_tokenizer()
  for text in ["Hello world! It's 12345 apples.", "  two  spaces\n\nnew\tlines", "中文 and ASCII", "WON'T x+y=z;"]:
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text) and hf.decode(ids) == text
  assert hf.eos_token_id == tok.eos_id and len(hf) == 4096
  text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert text == render_chat_text(MESSAGES, add_generation_prompt=True)
  ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
  assert ids == render_chat(MESSAGES, tokenizer=tok, add_generation_prompt=True)[0]


@pytest.mark.slow  # compiles a second model (128-wide heads) on top of the shared tiny one
def test_server_answers_a_text_chat_completion_from_the_export(export):
  server = Server(export, engine_config=EngineConfig(max_slots=2, max_seq_len=64), port=0).start()
  try:
    assert server.tokenizer is not None and server.tokenizer.path == os.path.join(export, "tiktoken.model")
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(
      f"{server.url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
      out = json.load(resp)
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    prompt_ids = render_chat(MESSAGES, tokenizer=server.tokenizer, add_generation_prompt=True)[0]
    assert out["usage"]["prompt_tokens"] == len(prompt_ids) and 1 <= out["usage"]["completion_tokens"] <= 6
  finally:
    server.close()
