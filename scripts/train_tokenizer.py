"""Trains the bundled tiny byte-level BPE on the bundled corpus and writes it in tiktoken format.

  python scripts/train_tokenizer.py [--num_merges=3584] [--out=data/tokenizer/k2tiny.tiktoken]

HF `tokenizers` (Rust) trains the merges, with K2's pre-tokenisation regex so training and tiktoken
encoding split text the same way. The result is saved exactly like K2's `tiktoken.model`: the 256
single bytes get ranks 0..255, then every merged token in merge order, so tiktoken's "lowest rank
first" merging replays the trained merge priority. 256 + 3584 ranks + 256 K2 specials = 4096 ids.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import base64  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from k2jax.convert.tokenizer import bytes_to_unicode  # noqa: E402
from k2jax.data import corpus, tokenizer  # noqa: E402

_MERGES = flags.DEFINE_integer("num_merges", 3584, "Number of BPE merges to learn.")
_OUT = flags.DEFINE_string("out", tokenizer.BUNDLED_TOKENIZER, "Output tiktoken rank file.")
_CORPUS = flags.DEFINE_string("corpus", corpus.BUNDLED_CORPUS, "jsonl corpus with a `text` field.")


def train_ranks(texts, num_merges: int) -> dict[bytes, int]:
  """Byte-level BPE ranks: bytes 0..255 first, then merged tokens in merge order."""
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(tokenizer.PAT_STR), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  bpe.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=256 + num_merges,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
    min_frequency=2,
  )
  bpe.train_from_iterator(texts, trainer=trainer)
  merges = json.loads(bpe.to_str())["model"]["merges"]
  byte_of = {c: b for b, c in bytes_to_unicode().items()}  # ByteLevel's printable char -> byte
  ranks = {bytes([b]): b for b in range(256)}
  for merge in merges:
    left, right = merge if isinstance(merge, list) else merge.split(" ")
    token = bytes(byte_of[c] for c in left + right)
    if token not in ranks:  # A later merge can rebuild an existing string; keep the first rank.
      ranks[token] = len(ranks)
  return ranks


def write_tiktoken_file(ranks: dict[bytes, int], path: str) -> None:
  """Writes `base64(token) rank` lines, the format `tiktoken.load.load_tiktoken_bpe` reads.

  tiktoken's own `dump_tiktoken_bpe` needs the optional `blobfile` package for local paths too.
  """
  with open(path, "w", encoding="ascii") as f:
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
      f.write(f"{base64.b64encode(token).decode()} {rank}\n")


def main(argv):
  del argv
  with open(_CORPUS.value, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f if line.strip()]
  ranks = train_ranks(texts, _MERGES.value)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  write_tiktoken_file(ranks, _OUT.value)
  tok = tokenizer.load_tokenizer(_OUT.value)
  n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
  n_chars = sum(len(t) for t in texts)
  print(f"ranks={len(ranks)} vocab_size={tok.vocab_size} chars_per_token={n_chars / n_tokens:.3f}")


if __name__ == "__main__":
  app.run(main)
