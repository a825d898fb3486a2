"""SFT input pipeline: K2 chat-format conversations -> packed batches with assistant-only loss.

Records are JSON objects `{"messages": [...], "tools": [...]}` (OpenAI style: `tool_calls`,
`tool_call_id`) in jsonl / ArrayRecord / parquet. Each conversation is rendered by `render_chat`
(chat.py); its token mask (1 on assistant content, tool-call section and closing <|im_end|>) becomes
the batch `loss_mask` after the next-token shift: `loss_mask[b, t] = 1` iff `targets[b, t]` is an
assistant token of the same conversation. Batches have the same keys and dtypes as pretraining.
"""

from __future__ import annotations

import dataclasses
import json

import grain
import numpy as np

from k2jax.data.chat import (
  ChatFormatError,
  UnknownRoleError,
  normalize_messages,
  parse_assistant,
  parse_chat,
  render_chat,
  render_chat_text,
)
from k2jax.data.packing import pack_and_batch
from k2jax.data.report import Issue
from k2jax.data.sources import HoldoutSplit, SourceSpec, decode_record, open_source, training_records
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer

__all__ = [
  "SFTDataConfig",
  "make_sft_iter",
  "build_sft_dataset",
  "render_chat",
  "render_chat_text",
  "parse_assistant",
  "parse_chat",
  "normalize_messages",
  "RenderConversation",
]


@dataclasses.dataclass(frozen=True)
class SFTDataConfig:
  """SFT data; fields mean what they mean in `PretrainDataConfig`."""

  sources: tuple[SourceSpec, ...]
  seq_len: int = 1024
  batch_size: int = 8
  seed: int = 0
  tokenizer_path: str = BUNDLED_TOKENIZER
  num_epochs: int | None = None
  num_workers: int = 0
  worker_buffer_size: int = 2
  read_threads: int = 0
  num_packing_bins: int = 256
  default_system: str | None = None  # K2's template inserts chat.K2_DEFAULT_SYSTEM.
  holdout: HoldoutSplit | None = None  # records set aside for evaluation, never read (sources.HoldoutSplit)


def make_sft_iter(cfg: SFTDataConfig, *, process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
  """The SFT batch iterator for one JAX process (supports get_state/set_state, `.report`)."""
  return iter(build_sft_dataset(cfg, process_index=process_index, process_count=process_count))


def build_sft_dataset(cfg: SFTDataConfig, *, process_index: int, process_count: int) -> grain.IterDataset:
  if not cfg.sources:
    raise ValueError("SFTDataConfig.sources is empty")
  load_tokenizer(cfg.tokenizer_path)  # Fails now, naming the path, if it is bad.
  parts = []
  for i, spec in enumerate(cfg.sources):
    ds = training_records(open_source(spec), cfg.holdout)[process_index::process_count]
    ds = ds.shuffle(seed=cfg.seed + 7919 * i).repeat(cfg.num_epochs)
    parts.append(ds.map(RenderConversation(cfg.tokenizer_path, cfg.default_system)))
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [s.weight for s in cfg.sources])
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(64, 4 * cfg.batch_size))
  )
  return pack_and_batch(
    it,
    seq_len=cfg.seq_len,
    batch_size=cfg.batch_size,
    num_packing_bins=cfg.num_packing_bins,
    seed=cfg.seed,
    num_workers=cfg.num_workers,
    worker_buffer_size=cfg.worker_buffer_size,
  )


class RenderConversation(grain.transforms.Map):
  """Raw record -> `{"input_ids", "token_mask", "issue"}`; bad conversations become empty + issue."""

  def __init__(self, tokenizer_path: str, default_system: str | None):
    self.tokenizer_path, self.default_system = tokenizer_path, default_system

  def map(self, raw) -> dict:
    obj, issue = decode_record(raw)
    if obj is None:
      return _dropped(issue)
    messages, tools = obj.get("messages"), obj.get("tools")
    if isinstance(messages, str):  # Some datasets store the list JSON-encoded.
      try:
        messages = json.loads(messages)
      except ValueError:
        return _dropped(Issue.BAD_MESSAGES)
    if messages is None:
      return _dropped(Issue.MISSING_FIELD)
    try:
      ids, mask = render_chat(
        messages, tools, tokenizer=load_tokenizer(self.tokenizer_path), default_system=self.default_system
      )
    except UnknownRoleError:
      return _dropped(Issue.UNKNOWN_ROLE)
    except (ChatFormatError, TypeError, AttributeError):
      return _dropped(Issue.BAD_MESSAGES)
    if not any(mask):
      return _dropped(Issue.NO_ASSISTANT)
    return {
      "input_ids": np.asarray(ids, np.int32),
      "token_mask": np.asarray(mask, np.int32),
      "issue": np.int32(Issue.OK),
    }


def _dropped(issue: Issue) -> dict:
  empty = np.zeros(0, np.int32)
  return {"input_ids": empty, "token_mask": empty, "issue": np.int32(issue)}
