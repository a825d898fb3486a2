"""k2jax data layer: K2 tokenizer, grain pretraining and SFT pipelines, chat format, rephrasing."""

from k2jax.data.chat import (
  K2_DEFAULT_SYSTEM,
  ChatFormatError,
  UnknownRoleError,
  normalize_messages,
  parse_assistant,
  parse_chat,
  render_chat,
  render_chat_text,
)
from k2jax.data.checkpoint import restore_args, restore_state, save_args, save_state
from k2jax.data.corpus import BUNDLED_CORPUS, BUNDLED_CORPUS_ARRAY_RECORD
from k2jax.data.packing import BATCH_KEYS
from k2jax.data.pretrain import PretrainDataConfig, build_pretrain_dataset, make_pretrain_iter
from k2jax.data.report import DataReport, Issue
from k2jax.data.sft import SFTDataConfig, build_sft_dataset, make_sft_iter
from k2jax.data.sources import SourceSpec
from k2jax.data.tokenizer import BUNDLED_TOKENIZER, Tokenizer, load_tokenizer
