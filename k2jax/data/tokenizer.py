"""Kimi K2 tokenizer: tiktoken BPE ranks from a local file plus K2's 256 reserved special tokens.

The file is a tiktoken rank file (one `base64(token_bytes) rank` line per token), the format of K2's
own `tiktoken.model`. Loading never touches the network (`tiktoken.load.load_tiktoken_bpe` on a path).
Special tokens follow K2's layout: with N = number of BPE ranks, ids N .. N+255 are specials, so the
vocab is N + 256 (163,584 + 256 = 163,840 for the released model). Names come from a
`tokenizer_config.json` next to the rank file when there is one (`added_tokens_decoder`, as in the HF
repo), else from K2's published table below; unnamed slots are `<|reserved_token_{id}|>` as in
Moonshot's `tokenization_kimi.py`.

The repo ships a small BPE (`BUNDLED_TOKENIZER`, trained by `scripts/train_tokenizer.py` on the
bundled corpus) in the same format, so tests and demos use the real loading path.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import tiktoken
from tiktoken.load import load_tiktoken_bpe

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_TOKENIZER = str(REPO_ROOT / "data" / "tokenizer" / "k2tiny.tiktoken")

NUM_RESERVED_SPECIAL_TOKENS = 256
RANK_FILE = "tiktoken.model"  # the rank file's name in a Kimi-K2 HF directory

# K2's pre-tokenisation regex (tokenization_kimi.py): Han runs first, case-aware Latin words with
# English contractions, digits in groups of 1-3, punctuation runs, newline and whitespace rules.
# `&&` is class intersection, supported by tiktoken's fancy-regex (and by Oniguruma for training).
PAT_STR = "|".join(
  [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
  ]
)

# Offsets from the first special id (163584 in K2), from moonshotai/Kimi-K2 tokenizer_config.json.
K2_SPECIAL_OFFSETS = {
  "[BOS]": 0,
  "[EOS]": 1,
  "<|im_end|>": 2,
  "<|im_user|>": 3,
  "<|im_assistant|>": 4,
  "<|start_header_id|>": 6,
  "<|end_header_id|>": 7,
  "[EOT]": 9,
  "<|im_system|>": 10,
  "<|tool_calls_section_begin|>": 11,
  "<|tool_calls_section_end|>": 12,
  "<|tool_call_begin|>": 13,
  "<|tool_call_argument_begin|>": 14,
  "<|tool_call_end|>": 15,
  "<|im_middle|>": 17,
}

# tiktoken can be very slow (quadratic) on huge runs without a pre-tokenisation split point
# (openai/tiktoken#195); Moonshot's wrapper cuts input at these sizes first, and so do we.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


class Tokenizer:
  """A tiktoken `Encoding` with K2's special tokens and the ids the data layer needs.

  `encode` treats special-token text inside `text` as ordinary text (data can never inject control
  tokens); `encode_with_specials` maps special-token text to its id (for rendered chat templates).
  """

  def __init__(self, path: str, mergeable_ranks: dict[bytes, int], special_names: dict[int, str]):
    self.path = path
    num_base = len(mergeable_ranks)
    specials = {}
    for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS):
      specials[special_names.get(i, f"<|reserved_token_{i}|>")] = i
    self._enc = tiktoken.Encoding(
      name=Path(path).name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=specials
    )
    self.num_base_tokens = num_base
    self.special_ids: dict[str, int] = specials
    self.vocab_size: int = num_base + NUM_RESERVED_SPECIAL_TOKENS
    self.bos_id: int = specials["[BOS]"]
    self.eos_id: int = specials["[EOS]"]

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special-token strings in it are encoded as plain text."""
    if not isinstance(text, str):
      raise TypeError(f"Tokenizer.encode expects str, got {type(text).__name__}")
    ids: list[int] = []
    for piece in _split_for_tiktoken(text):
      ids.extend(self._enc.encode_ordinary(piece))
    return ids

  def encode_batch(self, texts: Sequence[str], num_threads: int = 4) -> list[list[int]]:
    """`encode` for many texts at once (tiktoken encodes them on a thread pool)."""
    if any(len(t) > _MAX_RUN_CHARS for t in texts):
      return [self.encode(t) for t in texts]
    return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

  def encode_with_specials(self, text: str) -> list[int]:
    """Token ids of `text` where every registered special-token string becomes its single id."""
    ids: list[int] = []
    for piece in _split_for_tiktoken(text):
      ids.extend(self._enc.encode(piece, allowed_special="all", disallowed_special=()))
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; special tokens appear as their names, invalid UTF-8 as U+FFFD."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad[:5]} outside [0, {self.vocab_size}) for tokenizer {self.path}")
    return self._enc.decode(ids, errors="replace")

  def token_name(self, token_id: int) -> str:
    """Printable name of one token (special name or its decoded bytes)."""
    return self._enc.decode([int(token_id)], errors="replace")


def load_tokenizer(path: str = BUNDLED_TOKENIZER) -> Tokenizer:
  """Loads a tiktoken rank file (e.g. Kimi K2's `tiktoken.model`) with K2's special tokens; a directory
  (a Kimi-K2 HF checkpoint as published) means its `tiktoken.model` + `tokenizer_config.json`.

  Raises FileNotFoundError naming `path` when it is missing, ValueError when it does not parse.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, RANK_FILE)
  return _load_cached(os.path.abspath(path))


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Tokenizer:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file not found: {path}")
  try:
    ranks = load_tiktoken_bpe(path)
  except Exception as e:  # tiktoken raises bare ValueError/binascii errors without the path.
    raise ValueError(f"cannot parse tiktoken rank file {path}: {e}") from e
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise ValueError(f"tiktoken rank file {path}: ranks are not contiguous 0..{len(ranks) - 1}")
  return Tokenizer(path, ranks, _special_names(path, len(ranks)))


def _special_names(path: str, num_base: int) -> dict[int, str]:
  """id -> name: from `tokenizer_config.json` beside `path` when present, else K2's table."""
  config = Path(path).with_name("tokenizer_config.json")
  if config.is_file():
    try:
      decoder = json.loads(config.read_text())["added_tokens_decoder"]
      return {int(i): tok["content"] for i, tok in decoder.items()}
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{config}: cannot read added_tokens_decoder: {e}") from e
  return {num_base + off: name for name, off in K2_SPECIAL_OFFSETS.items()}


def _split_for_tiktoken(text: str):
  """Cuts `text` so no piece is over _MAX_ENCODE_CHARS or has a (non-)whitespace run over _MAX_RUN_CHARS."""
  if len(text) <= _MAX_RUN_CHARS:  # Fast path: no run can be too long.
    yield text
    return
  start = 0
  for m in _LONG_RUN.finditer(text):
    for cut in range(m.start() + _MAX_RUN_CHARS, m.end(), _MAX_RUN_CHARS):
      yield from _fixed_pieces(text[start:cut])
      start = cut
  yield from _fixed_pieces(text[start:])


def _fixed_pieces(text: str):
  for i in range(0, max(len(text), 1), _MAX_ENCODE_CHARS):
    yield text[i : i + _MAX_ENCODE_CHARS]


_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_MAX_RUN_CHARS + 1, _MAX_RUN_CHARS + 1))
