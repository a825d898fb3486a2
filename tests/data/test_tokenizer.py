"""Tokenizer: K2 special-token layout, offline loading, lossless round trip."""

import base64
import json

import pytest

from k2jax.data import corpus
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, K2_SPECIAL_OFFSETS, load_tokenizer


def test_bundled_tokenizer_layout():
  tok = load_tokenizer(BUNDLED_TOKENIZER)
  assert tok.num_base_tokens == 3840 and tok.vocab_size == 4096
  assert tok.bos_id == 3840 and tok.eos_id == 3841
  for name, off in K2_SPECIAL_OFFSETS.items():
    assert tok.special_ids[name] == 3840 + off
  assert len(tok.special_ids) == 256 and max(tok.special_ids.values()) == tok.vocab_size - 1


def test_round_trip_and_compression_on_corpus():
  tok = load_tokenizer()
  with open(corpus.BUNDLED_CORPUS) as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(200), f)]
  texts += ["héllo wörld 中文字 🙂 \x00\t\r\n", "", " " * 30000 + "x" * 30000]
  n_chars = n_tokens = 0
  for t in texts:
    ids = tok.encode(t)
    assert tok.decode(ids) == t
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    n_chars, n_tokens = n_chars + len(t), n_tokens + len(ids)
  assert n_chars / n_tokens > 2.0  # The BPE really merges (bytes would give 1.0).


def test_special_text_is_plain_in_encode_but_special_when_asked():
  tok = load_tokenizer()
  assert tok.eos_id not in tok.encode("a [EOS] b <|im_end|>")
  assert tok.encode_with_specials("a<|im_end|>") == tok.encode("a") + [tok.special_ids["<|im_end|>"]]


def test_k2_sized_rank_file_gives_k2_ids(tmp_path):
  # A synthetic rank file with K2's 163,584 ranks: specials land on K2's published ids.
  path = tmp_path / "tiktoken.model"
  tokens = [bytes([b]) for b in range(256)] + [b"\xff" + i.to_bytes(3, "big") for i in range(163584 - 256)]
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
  tok = load_tokenizer(str(path))
  assert tok.vocab_size == 163840
  assert tok.bos_id == 163584 and tok.eos_id == 163585
  assert tok.special_ids["<|im_middle|>"] == 163601
  assert tok.special_ids["<|tool_call_argument_begin|>"] == 163598


def test_tokenizer_config_names_take_precedence(tmp_path):
  src = open(BUNDLED_TOKENIZER).read()
  (tmp_path / "tiktoken.model").write_text(src)
  (tmp_path / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "added_tokens_decoder": {
          "3840": {"content": "[BOS]"},
          "3841": {"content": "[EOS]"},
          "3850": {"content": "<|custom|>"},
        }
      }
    )
  )
  tok = load_tokenizer(str(tmp_path / "tiktoken.model"))
  assert tok.special_ids["<|custom|>"] == 3850 and tok.eos_id == 3841


def test_bad_paths_name_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.tiktoken"):
    load_tokenizer(str(tmp_path / "nope.tiktoken"))
  bad = tmp_path / "bad.tiktoken"
  bad.write_text("not base64 at all\n")
  with pytest.raises(ValueError, match="bad.tiktoken"):
    load_tokenizer(str(bad))
