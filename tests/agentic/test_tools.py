"""Tool registry: MCP/OpenAI forms, impact from annotations, schema and name errors, K2 rendering,
and hypothesis fuzzing of call parsing/validation (never raises outside the ToolError path)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2jax.agentic import (
  Impact,
  ToolError,
  ToolRegistry,
  ToolSpecError,
  parse_openai_calls,
  parse_turn,
  sanitize_name,
  tool_from_dict,
  validate_call,
)
from k2jax.data.chat import parse_chat, render_chat
from k2jax.data.tokenizer import load_tokenizer

MCP = {
  "name": "get_weather",
  "title": "Weather",
  "description": "Weather for a city.",
  "inputSchema": {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
  },
  "annotations": {"readOnlyHint": True},
}
OAI = {
  "type": "function",
  "function": {
    "name": "send_email",
    "description": "Send mail.",
    "parameters": {
      "type": "object",
      "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
      "required": ["to", "body"],
    },
  },
}


def registry():
  return ToolRegistry.from_dicts(
    [MCP, OAI, {"name": "delete_note", "inputSchema": {"type": "object"}, "annotations": {"destructiveHint": False}}]
  )


def test_forms_impacts_and_round_trip(tmp_path):
  reg = registry()
  assert reg["get_weather"].impact == Impact.READ_ONLY
  assert reg["send_email"].impact == Impact.IRREVERSIBLE  # no hints: MCP default destructive
  assert reg["delete_note"].impact == Impact.REVERSIBLE_WRITE
  assert tool_from_dict(reg["get_weather"].to_mcp()) == reg["get_weather"]
  assert tool_from_dict(reg["send_email"].to_openai()).input_schema == OAI["function"]["parameters"]
  path = tmp_path / "tools.json"
  path.write_text(json.dumps({"tools": [MCP]}))
  assert ToolRegistry.load_json(str(path)).names == ["get_weather"]
  # Rendered into the K2 template as the tool_declare message, and parsed back.
  tok = load_tokenizer()
  ids, mask = render_chat([{"role": "user", "content": "hi"}], reg.openai_tools(), tokenizer=tok)
  _, tools = parse_chat(ids, tokenizer=tok)
  assert [t["function"]["name"] for t in tools] == reg.names and sum(mask) == 0


@pytest.mark.parametrize(
  "bad, needle",
  [
    ({"name": "a.b", "inputSchema": {"type": "object"}}, "name must match"),
    ({"name": "x", "inputSchema": {"type": "array"}}, "type 'object'"),
    ({"name": "x", "inputSchema": {"type": "object", "properties": {"a": {"type": 5}}}}, "invalid inputSchema"),
    ({"name": "x"}, "needs 'inputSchema'"),
    ({"name": "x", "inputSchema": {"type": "object"}, "impact": "huge"}, "impact 'huge'"),
    ({"name": "x", "inputSchema": {"type": "object"}, "targets": ["nohost"]}, "host:port"),
  ],
)
def test_bad_specs_name_the_problem(bad, needle):
  with pytest.raises(ToolSpecError, match=needle):
    tool_from_dict(bad, "f.json[0]")


def test_bad_files(tmp_path):
  p = tmp_path / "t.json"
  p.write_text("{oops")
  with pytest.raises(ToolSpecError, match="t.json: not valid JSON"):
    ToolRegistry.load_json(str(p))
  with pytest.raises(FileNotFoundError, match="missing.json"):
    ToolRegistry.load_json(str(tmp_path / "missing.json"))
  assert sanitize_name("github/create.issue") == "github_create_issue"


def test_validation_errors_are_structured():
  reg = registry()
  ok = validate_call("functions.get_weather:0", "get_weather", '{"city": "Oslo"}', reg)
  assert ok.arguments == {"city": "Oslo"}
  cases = {
    "unknown_tool": ("nope", "{}"),
    "malformed_json": ("get_weather", "{city:"),
    "bad_arguments": ("get_weather", '{"city": ""}'),
  }
  for kind, (name, args) in cases.items():
    err = validate_call("functions.x:1", name, args, reg)
    assert isinstance(err, ToolError) and err.kind == kind, (kind, err)
    assert json.loads(err.content())["isError"] is True
  assert validate_call("i", "get_weather", "[1]", reg).kind == "bad_arguments"
  assert "days" in validate_call("i", "get_weather", '{"city": "a", "days": 0}', reg).message


def test_parse_turn_from_tokens():
  tok, reg = load_tokenizer(), registry()
  text = (
    "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|><|tool_call_begin|>functions.nope:1"
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
  )
  turn = parse_turn(tok.encode_with_specials(text), reg, tok)
  assert turn.content == "Checking." and [c.name for c in turn.calls] == ["get_weather"]
  assert [e.kind for e in turn.errors] == ["unknown_tool"] and turn.errors[0].call_id == "functions.nope:1"
  broken = parse_turn(tok.encode_with_specials("x<|tool_calls_section_begin|><|tool_call_begin|>f"), reg, tok)
  assert [e.kind for e in broken.errors] == ["malformed_call"]


_SPECIAL = [
  "<|tool_calls_section_begin|>",
  "<|tool_calls_section_end|>",
  "<|tool_call_begin|>",
  "<|tool_call_argument_begin|>",
  "<|tool_call_end|>",
  "<|im_end|>",
  "functions.get_weather:0",
  "functions.send_email:3",
  '{"city": "x"}',
  '{"to": 1}',
  "{",
  "}",
  '"',
  ":",
  "functions.",
  "\\u0000",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(_SPECIAL), st.text(max_size=8)), max_size=24))
def test_fuzz_parse_turn_text(pieces):
  tok = load_tokenizer()
  turn = parse_turn(tok.encode_with_specials("".join(pieces)), registry(), tok)
  assert all(isinstance(e, ToolError) for e in turn.errors)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=-5, max_value=5000), max_size=40))
def test_fuzz_parse_turn_ids(ids):
  tok = load_tokenizer()
  turn = parse_turn(ids, registry(), tok)  # includes ids outside the vocabulary
  assert all(isinstance(e, ToolError) for e in turn.errors)


_JSON = st.recursive(
  st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=6),
  lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
  max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
  st.sampled_from(["get_weather", "send_email", "delete_note", "zzz"]),
  st.one_of(_JSON.map(json.dumps), st.text(max_size=30), st.just("[" * 5000)),
)
def test_fuzz_validate_call(name, args):
  out = validate_call("functions.a:0", name, args, registry())
  assert isinstance(out, ToolError) or isinstance(out.arguments, dict)


@settings(max_examples=100, deadline=None)
@given(
  st.one_of(
    _JSON,
    st.lists(
      st.dictionaries(
        st.sampled_from(["id", "function", "type"]),
        _JSON | st.fixed_dictionaries({"name": st.text(max_size=10), "arguments": _JSON}),
        max_size=3,
      ),
      max_size=3,
    ),
  )
)
def test_fuzz_openai_calls(tool_calls):
  calls, errors = parse_openai_calls(tool_calls, registry())
  assert all(isinstance(e, ToolError) for e in errors) and all(isinstance(c.arguments, dict) for c in calls)
