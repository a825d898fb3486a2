"""The engine vocabulary checks its own invariants and names the offending SGLang field."""

import pytest

from k2jax.engine import GenerateRequest, GenerateResult, InvalidRequest, SamplingParams


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
    ({"temperature": -0.5}, "sampling_params.temperature"),
    ({"top_p": 0.0}, "sampling_params.top_p"),
    ({"top_p": 1.5}, "sampling_params.top_p"),
  ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
  with pytest.raises(InvalidRequest) as e:
    SamplingParams(**kwargs)
  assert e.value.field == field and isinstance(e.value, ValueError)


def test_request_needs_a_rid_and_a_prompt():
  with pytest.raises(InvalidRequest) as e:
    GenerateRequest("", (1,))
  assert e.value.field == "rid"
  with pytest.raises(InvalidRequest) as e:
    GenerateRequest("r", ())
  assert e.value.field == "input_ids"


def test_result_lengths_agree_and_completion_tokens_counts_outputs():
  res = GenerateResult("r", (5, 6), (-0.1, -0.2), (3, 3), "stop", 4, matched_stop=6)
  assert res.completion_tokens == 2
  with pytest.raises(ValueError, match="1 logprobs"):
    GenerateResult("r", (5, 6), (-0.1,), (3, 3), "stop", 4)
  with pytest.raises(ValueError, match="top_logprobs"):
    GenerateResult("r", (5, 6), (-0.1, -0.2), (3, 3), "length", 4, top_logprobs=(((5, -0.1),),))
  with pytest.raises(ValueError, match="finish_reason"):
    GenerateResult("r", (), (), (), "eos", 4)
