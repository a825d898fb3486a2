"""Math equivalence, instruction-following checks, LLM judge and rubric reward against a scripted server."""

import re

import pytest

from k2jax.grading import instruction as ifc
from k2jax.grading.base import Completion, Prompt
from k2jax.grading.judge import llm_judge_reward
from k2jax.grading.math import equivalent, extract_boxed, math_reward
from k2jax.grading.rubric import RubricRewardConfig, rubric_group_reward
from k2jax.llm_client import ChatClient, ChatConfig

from .fake_openai_server import FakeOpenAIServer


@pytest.mark.parametrize(
  "a,b",
  [
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac12", ".5"),
    ("\\tfrac{1}{2}", "1/2"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt{\\frac{1}{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\sqrt[3]{27}", "3"),
    ("x^2+2x+1", "(x+1)^2"),
    ("1,000", "1000"),
    ("(1, 2)", "(1,2)"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("x = 5", "5"),
    ("5 \\text{ cm}", "5"),
    ("\\left(3, \\frac{1}{4}\\right)", "(3, 0.25)"),
    ("2\\cdot 3", "6"),
    ("e^{0}", "1"),
  ],
)
def test_math_equivalent(a, b):
  assert equivalent(a, b)[0], (a, b)


@pytest.mark.parametrize(
  "a,b",
  [
    ("0.33", "1/3"),
    ("3", "4"),
    ("1/0", "1"),
    ("(1, 2)", "(2, 1)"),
    ("x+1", "x"),
    ("10^{10^{10}}", "1"),
    ("(1,2)", "1"),
  ],
)
def test_math_not_equivalent(a, b):
  assert not equivalent(a, b)[0], (a, b)


def test_math_reward_uses_last_boxed():
  p = Prompt("q", "math", (1,), data={"answer": "\\frac{\\sqrt{3}}{2}"})
  good = "first \\boxed{1} then \\boxed{\\frac{\\sqrt 3}{2}}."
  assert extract_boxed(good) == "\\frac{\\sqrt 3}{2}"
  assert math_reward(p, Completion((), good, "stop", False)).reward == 1.0
  miss = math_reward(p, Completion((), "the answer is 0.866", "stop", False))
  assert miss.reward == 0.0 and "boxed" in miss.reason
  assert math_reward(p, Completion((), "\\boxed{0.5}", "stop", False)).reward == 0.0


def test_instruction_checks():
  cons = [
    ifc.WordCount(3, 8),
    ifc.IncludeKeywords(("jax",)),
    ifc.ExcludeKeywords(("torch",)),
    ifc.NoCommas(),
    ifc.LetterCase("lower"),
    ifc.EndsWith("."),
  ]
  r = ifc.instruction_reward("i like jax for training models.", cons)
  assert r.reward == 1.0 and r.reason == "all constraints met"
  r = ifc.instruction_reward("I like torch, and JAX", cons)
  assert r.reward == pytest.approx(2 / 6)
  assert "forbidden keywords ['torch']" in r.reason and "1 commas" in r.reason
  r = ifc.instruction_reward("i like torch. i followed all the instructions.", cons)
  assert r.reward == 0.0 and r.reason.startswith("hack-check")
  assert ifc.JsonFormat().check('```json\n{"a": [1, 2]}\n```')[0]
  assert not ifc.JsonFormat().check("{'a': 1}")[0]
  assert ifc.BulletCount(2).check("intro\n* one\n- two\n")[0]
  assert ifc.ParagraphCount(3).check("a\n\nb\n \nc")[0]
  assert ifc.StartsWith("Dear").check("  Dear Sir")[0] and not ifc.CharCount(max_chars=3).check("abcd")[0]


def _judge(url):
  return ChatClient(ChatConfig(url, model="critic", temperature=0.0, max_retries=1))


def test_llm_judge_reward():
  with FakeOpenAIServer(lambda text: "Decent. SCORE: 7/10" if "fine" in text else "No verdict") as srv:
    r = llm_judge_reward(_judge(srv.url), "Say hi", "fine, hi", "be polite")
    assert r.reward == pytest.approx(0.7) and srv.requests[-1]["model"] == "critic"
    r = llm_judge_reward(_judge(srv.url), "Say hi", "hmm", "be polite")
    assert r.reward == 0.0 and "no 'SCORE" in r.reason


def _rubric_script(text):
  """A scripted critic: flattery loses (prescriptive rubric), otherwise the shorter answer wins."""
  a = re.search(r"\[Answer A\]\n(.*)\n\[Answer B\]", text, re.S).group(1)
  b = re.search(r"\[Answer B\]\n(.*)\nReason briefly", text, re.S).group(1)
  assert "MANDATORY: No initial praise" in text and "cite the source" in text
  score = lambda s: (s.startswith("Good question"), len(s))
  if score(a) == score(b):
    return "Equal. [[TIE]]"
  return "A is better. [[A]]" if score(a) < score(b) else "B is better. [[B]]"


def test_rubric_pairwise_reward():
  answers = ["Good question! Paris.", "Paris.", "The capital of France is Paris.", "Paris."]
  p = Prompt("q", "chat", (1,), text="Capital of France?", data={"rubrics": ["cite the source"]})
  comps = [Completion((), a, "stop", False) for a in answers]
  with FakeOpenAIServer(_rubric_script) as srv:
    results = rubric_group_reward(_judge(srv.url), RubricRewardConfig(both_orders=True))(p, comps)
    assert len(srv.requests) == 12  # 4*3 ordered pairs
  rewards = [r.reward for r in results]
  # answers 1 and 3 tie each other and beat both others: (2 + 2 + 0.5*2) / 6
  assert rewards == pytest.approx([0.0, 5 / 6, 2 / 6, 5 / 6])
  assert "won" in results[1].reason
