"""Shared helpers for the data tests (imported explicitly; not a conftest)."""

import collections
import json

import numpy as np

from k2jax.data import corpus
from k2jax.data.tokenizer import load_tokenizer


def corpus_texts(path=corpus.BUNDLED_CORPUS):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line)["text"] for line in f]


def expected_pieces(texts, seq_len):
  """Multiset of token sequences the packer must emit: doc + EOS, cut into seq_len pieces."""
  tok = load_tokenizer()
  out = collections.Counter()
  for t in texts:
    ids = tok.encode(t) + [tok.eos_id]
    for s in range(0, len(ids), seq_len):
      out[tuple(ids[s : s + seq_len])] += 1
  return out


def packed_pieces(batches):
  """Multiset of per-segment token sequences found in packed batches; checks row invariants."""
  out = collections.Counter()
  for b in batches:
    for ids, seg, pos, tgt, lm in zip(b["input_ids"], b["segment_ids"], b["positions"], b["targets"], b["loss_mask"]):
      k = int(seg.max())
      assert sorted(set(seg[seg > 0].tolist())) == list(range(1, k + 1))
      for s in range(1, k + 1):
        where = np.flatnonzero(seg == s)
        assert (np.diff(where) == 1).all(), "segment not contiguous"
        assert (pos[where] == np.arange(len(where))).all()
        assert (tgt[where[:-1]] == ids[where[1:]]).all()
        assert lm[where[-1]] == 0 and tgt[where[-1]] == 0
        out[tuple(ids[where].tolist())] += 1
      assert (ids[seg == 0] == 0).all() and (lm[seg == 0] == 0).all()
  return out
