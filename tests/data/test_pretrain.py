"""Pretraining pipeline: exact coverage, packing invariants and efficiency, sharding, sources,
mixtures, bad-input accounting."""

import itertools
import json

import numpy as np
import pytest

from k2jax.data import BUNDLED_CORPUS, BUNDLED_CORPUS_ARRAY_RECORD, Issue, PretrainDataConfig, SourceSpec
from k2jax.data.pretrain import make_pretrain_iter
from .helpers import corpus_texts, expected_pieces, packed_pieces


def _cfg(**kw):
  base = dict(seq_len=256, batch_size=4, num_epochs=1, seed=3)
  base.update(kw)
  return PretrainDataConfig(**base)


def test_every_token_exactly_once_and_contract():
  it = make_pretrain_iter(_cfg())
  batches = list(it)
  b = batches[0]
  assert set(b) == {"input_ids", "targets", "segment_ids", "positions", "loss_mask"}
  assert all(v.dtype == np.int32 and v.shape == (4, 256) for v in b.values())
  assert packed_pieces(batches) == expected_pieces(corpus_texts(), 256)
  # The loss counts every next-token prediction within a segment.
  n_docs_pieces = sum(expected_pieces(corpus_texts(), 256).values())
  assert (
    sum(int(x["loss_mask"].sum()) for x in batches)
    == sum(int((x["segment_ids"] > 0).sum()) for x in batches) - n_docs_pieces
  )
  assert it.report.documents == len(corpus_texts()) and it.report.dropped == 0


def test_packing_efficiency_at_1024():
  it = make_pretrain_iter(PretrainDataConfig(seq_len=1024, batch_size=8, num_epochs=None))
  nonpad = [float((b["segment_ids"] > 0).mean()) for b in itertools.islice(it, 160)]  # ~4.5 epochs
  assert np.mean(nonpad) >= 0.98, np.mean(nonpad)


def test_two_processes_disjoint_and_covering():
  seen = []
  for p in range(2):
    seen.append(packed_pieces(make_pretrain_iter(_cfg(), process_index=p, process_count=2)))
  want = expected_pieces(corpus_texts(), 256)
  assert seen[0] + seen[1] == want and sum(seen[0].values()) > 0.4 * sum(want.values())
  # Disjoint: a piece both processes emit must occur that often in the corpus itself.
  assert all(seen[0][p] + seen[1][p] <= want[p] for p in set(seen[0]) & set(seen[1]))


def test_jsonl_parquet_array_record_agree(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  texts = corpus_texts()
  pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet")
  want = expected_pieces(texts, 256)
  for spec in (
    SourceSpec(BUNDLED_CORPUS),
    SourceSpec(BUNDLED_CORPUS_ARRAY_RECORD),
    SourceSpec(str(tmp_path / "c.parquet"), text_field="body"),
  ):
    assert packed_pieces(make_pretrain_iter(_cfg(sources=(spec,)))) == want, spec


def test_pretokenized_input_ids(tmp_path):
  path = tmp_path / "ids.jsonl"
  path.write_text("".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in (5, 300, 9)))
  got = packed_pieces(make_pretrain_iter(_cfg(sources=(SourceSpec(str(path)),))))
  eos = 3841
  assert got == expected_ids([list(range(1, n)) + [eos] for n in (5, 300, 9)], 256)


def expected_ids(docs, seq_len):
  import collections

  return collections.Counter(tuple(d[s : s + seq_len]) for d in docs for s in range(0, len(d), seq_len))


def test_mixture_follows_weights(tmp_path):
  for name in "ab":
    (tmp_path / f"{name}.jsonl").write_text(
      "".join(json.dumps({"input_ids": [10 if name == "a" else 20] * 7}) + "\n" for _ in range(500))
    )
  cfg = _cfg(
    num_epochs=None,
    sources=(SourceSpec(str(tmp_path / "a.jsonl"), weight=3.0), SourceSpec(str(tmp_path / "b.jsonl"), weight=1.0)),
  )
  ids = np.concatenate([b["input_ids"].ravel() for b in itertools.islice(make_pretrain_iter(cfg), 20)])
  n_a, n_b = int((ids == 10).sum()), int((ids == 20).sum())
  assert abs(n_a / (n_a + n_b) - 0.75) < 0.02, (n_a, n_b)


def test_bad_input_is_counted_never_crashes(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = ["first good document", "second good document"]
  lines = [
    json.dumps({"text": good[0]}).encode(),
    b"{not json",
    b"\xff\xfe\x00 bytes",
    json.dumps({"text": "   "}).encode(),
    b"",
    json.dumps({"title": "no text"}).encode(),
    json.dumps({"input_ids": [1, 99999]}).encode(),
    json.dumps([1, 2]).encode(),
    json.dumps({"text": "long " * 900}).encode(),
    json.dumps({"text": good[1]}).encode(),
  ]
  path.write_bytes(b"\n".join(lines) + b"\n")
  it = make_pretrain_iter(_cfg(sources=(SourceSpec(str(path)),)))
  pieces = packed_pieces(list(it))
  r = it.report
  assert r[Issue.MALFORMED_JSON] == 2 and r[Issue.NOT_UTF8] == 1 and r[Issue.EMPTY] == 2
  assert r[Issue.MISSING_FIELD] == 1 and r[Issue.BAD_TOKEN_IDS] == 1
  assert r[Issue.OVERLONG_SPLIT] == 1 and r[Issue.OK] == 2
  assert r.documents == len(lines) and r.dropped == 7
  assert pieces == expected_pieces(good + ["long " * 900], 256)
  assert "dropped=7" in r.summary() and "not_utf8=1" in r.summary()


def test_missing_or_unreadable_source_fails_at_start(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    make_pretrain_iter(_cfg(sources=(SourceSpec(str(tmp_path / "missing.jsonl")),)))
  with pytest.raises(FileNotFoundError, match=r"nothing\*.array_record"):
    make_pretrain_iter(_cfg(sources=(SourceSpec(str(tmp_path / "nothing*.array_record")),)))
  broken = tmp_path / "broken.parquet"
  broken.write_bytes(b"PAR1 not really parquet")
  with pytest.raises(ValueError, match="broken.parquet"):
    make_pretrain_iter(_cfg(sources=(SourceSpec(str(broken)),)))
  with pytest.raises(FileNotFoundError, match="no_tok"):
    make_pretrain_iter(_cfg(tokenizer_path=str(tmp_path / "no_tok")))


def test_process_shards_are_disjoint_by_document(tmp_path):
  path = tmp_path / "u.jsonl"
  path.write_text("".join(json.dumps({"input_ids": [i + 1] * (i % 7 + 1)}) + "\n" for i in range(101)))
  cfg = _cfg(sources=(SourceSpec(str(path)),), append_eos=False)
  docs = [set(packed_pieces(make_pretrain_iter(cfg, process_index=p, process_count=2))) for p in range(2)]
  assert not docs[0] & docs[1]
  assert docs[0] | docs[1] == {tuple([i + 1] * (i % 7 + 1)) for i in range(101)}
  assert len(docs[0]) == 51 and len(docs[1]) == 50
