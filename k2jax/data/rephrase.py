"""K2 knowledge rephrasing (K2 §2.2): faithful rewrites of knowledge documents in diverse styles.

Three parts, as in the paper:
1. Style- and perspective-diverse prompts (WRAP-inspired): each rephrasing of a document draws a
   distinct (style, perspective) pair, deterministically from (seed, document id, k).
2. Chunk-wise autoregressive rewriting: a long document is cut at sentence boundaries into
   ~`chunk_tokens` pieces; piece i is rewritten with the *rewritten* piece i-1 as context, and the
   outputs are concatenated, which sidesteps the model's output-length limit (Fig. 4).
3. Fidelity verification: each rewritten piece is compared with its source (numbers kept, content-
   word recall, length ratio) and optionally judged by the same LLM; a failing rephrasing is
   recorded as rejected with its reason, never silently dropped.
The per-corpus cap (`max_rephrasings`, K2 uses at most 2) bounds rephrasings per document, also
across restarts. Any OpenAI-compatible chat endpoint works (`llm_url`, through `k2jax.llm_client`);
requests run concurrently (one thread per document in flight) and retry with exponential backoff.
Output is one jsonl line per finished document, appended as each finishes; a restart skips them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import random
import re

from k2jax.data.report import DataReport, Issue
from k2jax.data.sources import JsonlSource, decode_record, end_torn_line
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k2jax.llm_client import ChatClient, ChatConfig
from k2jax.transport import InvalidResponse

STYLES = (
  "an encyclopedia entry",
  "a textbook section for university students",
  "a question-and-answer dialogue",
  "plain language for a curious general reader",
  "a lecture transcript",
  "concise study notes",
  "a technical explanation for practitioners",
)
PERSPECTIVES = (
  "a neutral third-person narrator",
  "a teacher explaining to a student",
  "an expert reviewing the topic",
  "a journalist reporting the facts",
)
_STOP = frozenset(
  "this that with from have been were which their there these those what when "
  "where will would should could into than then them they your about also such "
  "only other some more most very each does done".split()
)


@dataclasses.dataclass(frozen=True)
class RephraseConfig:
  """Rephrasing run settings (`llm_url` is the OpenAI-compatible base URL, e.g. .../v1)."""

  llm_url: str
  model: str = "default"
  api_key: str = "EMPTY"
  num_rephrasings: int = 2
  max_rephrasings: int = 2  # Per-corpus cap (K2: each corpus rephrased at most twice).
  chunk_tokens: int = 256
  max_output_tokens: int = 1024
  temperature: float = 0.7
  concurrency: int = 8
  max_retries: int = 4  # retries (exponential backoff) per request.
  timeout_s: float = 120.0
  min_word_recall: float = 0.5  # Fidelity: share of source content words kept.
  length_ratio: tuple[float, float] = (0.5, 2.5)
  llm_judge: bool = False  # Also ask the endpoint whether the rewrite is faithful.
  seed: int = 0
  tokenizer_path: str = BUNDLED_TOKENIZER
  text_field: str = "text"
  id_field: str = "id"


def rephrase_corpus(cfg: RephraseConfig, input_path: str, output_path: str) -> dict:
  """Rephrases every document of the jsonl `input_path` into `output_path` (resumable).

  Returns counts: documents, skipped_finished, written, accepted, rejected, plus bad-input counts.
  """
  if not 1 <= cfg.num_rephrasings <= cfg.max_rephrasings:
    raise ValueError(
      f"num_rephrasings={cfg.num_rephrasings} must be in [1, max_rephrasings="
      f"{cfg.max_rephrasings}] (the per-corpus cap)"
    )
  source = JsonlSource(_existing(input_path))
  done = _finished_ids(output_path)
  report, pending = DataReport(), []
  for i in range(len(source)):
    obj, issue = decode_record(source[i])
    text = obj.get(cfg.text_field) if obj else None
    if obj is not None and not isinstance(text, str):
      issue = Issue.MISSING_FIELD
    elif obj is not None and not text.strip():
      issue = Issue.EMPTY
    report.add(_one_hot(issue))
    if issue == Issue.OK:
      doc_id = str(obj.get(cfg.id_field, f"line{i}"))
      if doc_id not in done:
        pending.append((doc_id, text))
  stats = {
    "documents": report.documents,
    "skipped_finished": report[Issue.OK] - len(pending),
    "written": 0,
    "accepted": 0,
    "rejected": 0,
    **report.as_dict(),
  }
  rephraser = Rephraser(cfg)
  end_torn_line(output_path)
  with open(output_path, "a", encoding="utf-8") as out, concurrent.futures.ThreadPoolExecutor(cfg.concurrency) as pool:
    futures = [pool.submit(rephraser.rephrase_document, d, t) for d, t in pending]
    for fut in concurrent.futures.as_completed(futures):
      record = fut.result()
      out.write(json.dumps(record, ensure_ascii=False) + "\n")
      out.flush()  # One complete line per finished document: the resume unit.
      stats["written"] += 1
      stats["accepted"] += len(record["rephrasings"])
      stats["rejected"] += len(record["rejected"])
  logging.info("rephrase: %s; %s", stats, report.summary())
  return stats


class Rephraser:
  """Rewrites one document (all its rephrasings); thread-safe, holds one HTTP client."""

  def __init__(self, cfg: RephraseConfig):
    self.cfg = cfg
    self.tok = load_tokenizer(cfg.tokenizer_path)
    self.client = ChatClient(
      ChatConfig(
        url=cfg.llm_url,
        model=cfg.model,
        api_key=cfg.api_key,
        temperature=cfg.temperature,
        max_tokens=cfg.max_output_tokens,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        concurrency=cfg.concurrency,
      )
    )

  def rephrase_document(self, doc_id: str, text: str) -> dict:
    chunks = split_into_chunks(text, self.cfg.chunk_tokens, self.tok.encode)
    record = {"id": doc_id, "num_chunks": len(chunks), "rephrasings": [], "rejected": []}
    for k, (style, perspective) in enumerate(pick_styles(self.cfg.seed, doc_id, self.cfg.num_rephrasings)):
      pieces, reasons, previous = [], [], ""
      for chunk in chunks:
        previous = self._complete(rewrite_prompt(chunk, previous, style, perspective))
        pieces.append(previous)
        reason = self._fidelity_problem(chunk, previous)
        if reason:
          reasons.append(reason)
      entry = {"k": k, "style": style, "perspective": perspective, "text": "\n\n".join(pieces)}
      if reasons:
        record["rejected"].append({**entry, "reason": "; ".join(reasons)})
      else:
        record["rephrasings"].append(entry)
    return record

  def _complete(self, messages: list[dict]) -> str:
    content = self.client.text(messages).strip()
    if not content:
      raise InvalidResponse(f"{self.cfg.llm_url}: completion without content")
    return content

  def _fidelity_problem(self, source: str, rewrite: str) -> str | None:
    problem = fidelity_problem(source, rewrite, self.cfg.min_word_recall, self.cfg.length_ratio)
    if problem is None and self.cfg.llm_judge:
      verdict = self._complete(judge_prompt(source, rewrite))
      if not verdict.upper().startswith("YES"):
        problem = f"llm judge: {verdict[:80]!r}"
    return problem


def pick_styles(seed: int, doc_id: str, n: int) -> list[tuple[str, str]]:
  """n distinct (style, perspective) pairs, a fixed function of (seed, doc_id)."""
  pairs = [(s, p) for s in STYLES for p in PERSPECTIVES]
  digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()  # Stable across processes.
  return random.Random(digest).sample(pairs, n)


def split_into_chunks(text: str, chunk_tokens: int, encode) -> list[str]:
  """Cuts text at paragraph/sentence ends into pieces of about `chunk_tokens` tokens."""
  sentences = [s for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", text) if s.strip()]
  chunks, current, size = [], [], 0
  for s in sentences:
    n = len(encode(s))
    if current and size + n > chunk_tokens:
      chunks.append(" ".join(current))
      current, size = [], 0
    current.append(s.strip())
    size += n
  if current:
    chunks.append(" ".join(current))
  return chunks


def rewrite_prompt(chunk: str, previous_rewrite: str, style: str, perspective: str) -> list[dict]:
  context = (
    f"Your rewrite of the preceding part (continue from it; do not repeat it):\n{previous_rewrite}\n\n"
    if previous_rewrite
    else ""
  )
  return [
    {
      "role": "system",
      "content": "You rewrite text faithfully: keep every fact, number and "
      "name, add nothing, and output only the rewritten text.",
    },
    {
      "role": "user",
      "content": f"Rewrite the passage below as {style}, written from the "
      f"perspective of {perspective}.\n\n{context}Passage:\n{chunk}",
    },
  ]


def judge_prompt(source: str, rewrite: str) -> list[dict]:
  return [
    {
      "role": "user",
      "content": "Does the REWRITE state the same facts as the SOURCE, with "
      "nothing added or lost? Answer YES or NO first.\n\n"
      f"SOURCE:\n{source}\n\nREWRITE:\n{rewrite}",
    }
  ]


def fidelity_problem(
  source: str, rewrite: str, min_word_recall: float, length_ratio: tuple[float, float]
) -> str | None:
  """Why `rewrite` is not a faithful rewrite of `source`, or None if it passes."""
  missing = sorted(set(re.findall(r"\d+(?:\.\d+)?", source)) - set(re.findall(r"\d+(?:\.\d+)?", rewrite)))
  if missing:
    return f"numbers lost: {missing[:5]}"
  ratio = len(rewrite) / max(len(source), 1)
  if not length_ratio[0] <= ratio <= length_ratio[1]:
    return f"length ratio {ratio:.2f} outside {length_ratio}"
  words = _content_words(source)
  recall = len(words & _content_words(rewrite)) / max(len(words), 1)
  if recall < min_word_recall:
    return f"content-word recall {recall:.2f} < {min_word_recall}"
  return None


def _content_words(text: str) -> set[str]:
  return {w for w in re.findall(r"[a-z]{4,}", text.lower()) if w not in _STOP}


def _finished_ids(output_path: str) -> set[str]:
  """Ids already written; a torn last line (crash mid-write) is ignored and redone."""
  if not os.path.exists(output_path):
    return set()
  done = set()
  with open(output_path, "rb") as f:
    for line in f:
      obj, issue = decode_record(line)
      if issue == Issue.OK and "id" in obj:
        done.add(str(obj["id"]))
  return done


def _existing(path: str) -> str:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"rephrase input not found: {path}")
  return path


def _one_hot(issue: Issue):
  counts = [0] * len(Issue)
  counts[issue] = 1
  return counts
