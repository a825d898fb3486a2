"""SFT: K2 chat format round trip, assistant-only loss mask, pipeline and bad conversations."""

import json

import numpy as np
import pytest

from k2jax.data import (
  ChatFormatError,
  Issue,
  SFTDataConfig,
  SourceSpec,
  UnknownRoleError,
  load_tokenizer,
  make_sft_iter,
  normalize_messages,
  parse_assistant,
  parse_chat,
  render_chat,
  render_chat_text,
)

TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_weather",
      "description": "Weather for a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
  }
]
CONV = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Weather in Paris and Rome? <|im_end|> is just text here."},
  {
    "role": "assistant",
    "content": "Checking.",
    "tool_calls": [
      {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
      {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ],
  },
  {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": '{"sky": "sunny"}'},
  {"role": "tool", "tool_call_id": "call_b", "content": '{"sky": "rain"}'},
  {"role": "assistant", "content": "Paris: sunny. Rome: rain."},
]


def test_render_matches_k2_text_format():
  text = render_chat_text(CONV, TOOLS)
  assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather"')
  assert (
    "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
  ) in text
  assert '<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n{"sky": "sunny"}<|im_end|>' in text
  assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n" in text
  assert render_chat_text(CONV[:2], add_generation_prompt=True).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_round_trip_recovers_messages_and_tool_calls():
  tok = load_tokenizer()
  ids, _ = render_chat(CONV, TOOLS, tokenizer=tok)
  messages, tools = parse_chat(ids, tokenizer=tok)
  want, want_tools = normalize_messages(CONV, TOOLS)
  assert messages == want and tools == want_tools
  assert messages[2]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
  assert messages[1]["content"] == CONV[1]["content"]  # Special-token text in content stays text.
  # Text input too, where contents hold no special-token text (text cannot tell them apart).
  plain = [dict(m, content="Weather?") if m["role"] == "user" else m for m in CONV]
  assert parse_chat(render_chat_text(plain, TOOLS), tokenizer=tok)[0] == normalize_messages(plain)[0]


def test_loss_mask_is_exactly_the_assistant_tokens():
  tok = load_tokenizer()
  ids, mask = render_chat(CONV, TOOLS, tokenizer=tok)
  sp = tok.special_ids
  want = []
  for m in normalize_messages(CONV)[0]:
    if m["role"] == "assistant":
      body = tok.encode(m["content"])
      if m.get("tool_calls"):
        body += [sp["<|tool_calls_section_begin|>"]]
        for c in m["tool_calls"]:
          body += (
            [sp["<|tool_call_begin|>"]]
            + tok.encode(c["id"])
            + [sp["<|tool_call_argument_begin|>"]]
            + tok.encode(c["function"]["arguments"])
            + [sp["<|tool_call_end|>"]]
          )
        body += [sp["<|tool_calls_section_end|>"]]
      want += body + [sp["<|im_end|>"]]
  assert [i for i, m in zip(ids, mask) if m] == want
  # No user/system/tool/declaration text is trained on.
  trained = tok.decode([i for i, m in zip(ids, mask) if m])
  assert "sunny" not in trained.replace("Paris: sunny", "") and "tool_declare" not in trained


def test_parse_assistant_generation():
  tok = load_tokenizer()
  out = parse_assistant(
    "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>ignored",
    tokenizer=tok,
  )
  assert out == {
    "role": "assistant",
    "content": "Sure.",
    "tool_calls": [
      {
        "id": "functions.get_weather:3",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
      }
    ],
  }
  assert parse_assistant("plain answer", tokenizer=tok) == {"role": "assistant", "content": "plain answer"}
  broken = parse_assistant("x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", tokenizer=tok)
  assert "tool_calls" not in broken and "not terminated" in broken["tool_call_error"]


def test_bad_messages_raise_naming_the_field():
  with pytest.raises(UnknownRoleError, match=r"messages\[0\].role"):
    render_chat([{"role": "wizard", "content": "x"}])
  with pytest.raises(ChatFormatError, match=r"arguments"):
    render_chat([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}])
  with pytest.raises(ChatFormatError, match=r"contains"):
    render_chat([{"role": "assistant", "tool_calls": [{"function": {"name": "a.b", "arguments": "{}"}}]}])


def test_sft_pipeline_masks_and_counts_bad_conversations(tmp_path):
  path = tmp_path / "sft.jsonl"
  rows = [
    json.dumps({"messages": CONV, "tools": TOOLS}),
    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
    json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
    json.dumps({"messages": [{"role": "user", "content": "only a prompt"}]}),
    json.dumps({"messages": "not json ["}),
    "{broken",
    json.dumps({"prompt": "no messages"}),
  ]
  path.write_text("\n".join(rows) + "\n")
  it = make_sft_iter(SFTDataConfig(sources=(SourceSpec(str(path)),), seq_len=256, batch_size=2, num_epochs=1))
  batches = list(it)
  tok = load_tokenizer()
  want = []
  for conv, tools in ((CONV, TOOLS), (json.loads(rows[1])["messages"], None)):
    ids, mask = render_chat(conv, tools, tokenizer=tok)
    want.append(sorted(i for i, m in zip(ids, mask) if m))
  trained = [b["targets"][b["loss_mask"] == 1] for b in batches]
  assert sorted(np.concatenate(trained).tolist()) == sorted(want[0] + want[1])
  r = it.report
  assert (r[Issue.OK], r[Issue.UNKNOWN_ROLE], r[Issue.NO_ASSISTANT]) == (2, 1, 1)
  assert (r[Issue.BAD_MESSAGES], r[Issue.MALFORMED_JSON], r[Issue.MISSING_FIELD]) == (1, 1, 1)
  assert set(batches[0]) == {"input_ids", "targets", "segment_ids", "positions", "loss_mask"}
