"""The tokenizer files of an exported HF directory, so the export serves text prompts on its own.

Kimi-K2's HF repo ships `tiktoken.model` (the rank file) and a `tokenizer_config.json` whose
`added_tokens_decoder` names the 256 reserved specials; loading it through `AutoTokenizer` needs Moonshot's
remote code. An export here writes both files in that layout, plus a `tokenizer.json` (HF `tokenizers`
byte-level BPE built from the same ranks and pre-tokenizer regex, the conversion transformers' own
`TikTokenConverter` performs) with `tokenizer_class: PreTrainedTokenizerFast`, so `AutoTokenizer`,
SGLang and sglang-jax load it offline with no remote code (sglang-jax's transformers 4.x does not load
transformers 5's `TokenizersBackend` class, reference §2.6). The config's `chat_template` renders K2's chat
format (`k2jax/data/chat.py`) for OpenAI chat endpoints.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil

from tiktoken.load import load_tiktoken_bpe

from k2jax.data.tokenizer import BUNDLED_TOKENIZER, PAT_STR, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json")

# K2's chat format (k2jax/data/chat.py) for messages whose tool-call ids are already K2 ids
# (`functions.{name}:{idx}`); k2jax's own server renders with chat.py and normalizes ids itself.
CHAT_TEMPLATE = (
  "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
  "{%- endif -%}"
  "{%- for m in messages -%}"
  "{%- set role_token = {'system': '<|im_system|>', 'user': '<|im_user|>', 'assistant': '<|im_assistant|>',"
  " 'tool': '<|im_system|>'}[m['role']] -%}"
  "{{ role_token }}{{ m.get('name') or m['role'] }}<|im_middle|>"
  "{%- if m['role'] == 'tool' -%}## Return of {{ m['tool_call_id'] }}\n{{ m['content'] }}"
  "{%- elif m['content'] -%}{{ m['content'] }}{%- endif -%}"
  "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
  "{%- for c in m['tool_calls'] -%}<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>"
  "{{ c['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
  "{%- endif -%}<|im_end|>"
  "{%- endfor -%}"
  "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def export_tokenizer(dst: str, vocab_size: int, src: str | None = None) -> str | None:
  """Writes the tokenizer of a model with `vocab_size` into the HF directory `dst`; returns its rank file.

  The tokenizer is `src`'s own `tiktoken.model` when the source has one, else the bundled BPE when its
  vocabulary fits; with neither (e.g. a model trained on another tokenizer) nothing is written and the
  export serves token ids only (logged).
  """
  own = os.path.join(src, "tiktoken.model") if src else None
  if own and os.path.isfile(own):
    path = own
  elif load_tokenizer(BUNDLED_TOKENIZER).vocab_size == vocab_size:
    path = BUNDLED_TOKENIZER
  else:
    log.warning("no tokenizer with vocab %d for %s: the export serves token ids only", vocab_size, dst)
    return None
  tok = load_tokenizer(path)
  if tok.vocab_size != vocab_size:
    raise ValueError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}")
  write_tokenizer(dst, tok)
  return path


def write_tokenizer(dst: str, tok: Tokenizer) -> None:
  """`tiktoken.model`, `tokenizer_config.json` (Kimi-K2 layout) and `tokenizer.json` into `dst`."""
  os.makedirs(dst, exist_ok=True)
  rank_file = os.path.join(dst, "tiktoken.model")
  if os.path.abspath(tok.path) != os.path.abspath(rank_file):
    shutil.copyfile(tok.path, rank_file)
  specials = sorted(tok.special_ids.items(), key=lambda kv: kv[1])
  with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
    json.dump(_tokenizer_config(specials), f, indent=2, ensure_ascii=False)
  with open(os.path.join(dst, "tokenizer.json"), "w") as f:
    json.dump(_tokenizer_json(tok, specials), f, ensure_ascii=False)


def _tokenizer_config(specials: list[tuple[str, int]]) -> dict:
  decoder = {
    str(i): {
      "content": name,
      "lstrip": False,
      "normalized": False,
      "rstrip": False,
      "single_word": False,
      "special": True,
    }
    for name, i in specials
  }
  named = [n for n, _ in specials if not n.startswith("<|reserved_token_") and n not in ("[BOS]", "[EOS]")]
  return {
    "added_tokens_decoder": decoder,
    "additional_special_tokens": named,
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1_000_000,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
  }


def _tokenizer_json(tok: Tokenizer, specials: list[tuple[str, int]]) -> dict:
  """HF `tokenizers` serialisation of a byte-level BPE equal to the tiktoken encoding."""
  byte_char = bytes_to_unicode()
  ranks = load_tiktoken_bpe(tok.path)
  as_text = lambda b: "".join(byte_char[x] for x in b)  # noqa: E731
  vocab = {as_text(b): r for b, r in ranks.items()}
  merges = []
  for token, rank in ranks.items():  # every split of a token into two tokens; tiktoken merges by rank
    if len(token) == 1:
      continue
    pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
    merges += [(rank, ranks[l], ranks[r], as_text(l), as_text(r)) for l, r in pairs]
  merges.sort()
  return {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [
      {
        "id": i,
        "content": name,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
      }
      for name, i in specials
    ],
    "normalizer": None,
    "pre_tokenizer": {
      "type": "Sequence",
      "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
      ],
    },
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {
      "type": "BPE",
      "dropout": None,
      "unk_token": None,
      "continuing_subword_prefix": None,
      "end_of_word_suffix": None,
      "fuse_unk": False,
      "byte_fallback": False,
      "ignore_merges": True,
      "vocab": vocab,
      "merges": [[l, r] for *_, l, r in merges],
    },
  }


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map used by byte-level BPE (also scripts/train_tokenizer.py)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}
