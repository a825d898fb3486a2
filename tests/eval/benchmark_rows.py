"""A few rows of each benchmark, in the published field names.

AIME 2024 I #1, AIME 2025 I #1, MATH-500's first test row and IFEval key 1000 are the public rows as we know
them (text written from memory of the published problems: the answers and fields are exact, a character of
the statements may differ). The GPQA and MMLU-Pro rows are written by hand in the published schema (their
questions are not copied from the datasets: GPQA asks not to reveal its questions online).
"""

AIME24 = [  # HuggingFaceH4/aime_2024: id, problem, solution, answer, url, year
  {
    "id": 60,
    "problem": "Every morning Aya goes for a $9$-kilometer-long walk and stops at a coffee shop afterwards. When "
    "she walks at a constant speed of $s$ kilometers per hour, the walk takes her 4 hours, including $t$ minutes "
    "spent in the coffee shop. When she walks $s+2$ kilometers per hour, the walk takes her 2 hours and 24 "
    "minutes, including $t$ minutes spent in the coffee shop. Suppose Aya walks at $s+\\frac{1}{2}$ kilometers "
    "per hour. Find the number of minutes the walk takes her, including the $t$ minutes spent in the coffee shop.",
    "solution": "$\\frac{9}{s} + t = 4$ ... so the walk takes $\\boxed{204}$ minutes.",
    "answer": "204",
    "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1",
    "year": 2024,
  },
]
AIME25 = [  # opencompass/AIME2025: question, answer
  {"question": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b$.", "answer": "70"},
]
MATH500 = [  # HuggingFaceH4/MATH-500 test.jsonl
  {
    "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in "
    "the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
    "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
    "subject": "Precalculus",
    "level": 2,
    "unique_id": "test/precalculus/807.json",
  },
]
GPQA = [  # Idavidrein/gpqa gpqa_diamond.csv columns (hand-written rows)
  {
    "Record ID": "recHand001",
    "Question": "Which particle mediates the electromagnetic interaction?",
    "Correct Answer": "The photon",
    "Incorrect Answer 1": "The gluon",
    "Incorrect Answer 2": "The W boson",
    "Incorrect Answer 3": "The Higgs boson",
  },
  {
    "Record ID": "recHand002",
    "Question": "What is the ground-state term symbol of atomic carbon?",
    "Correct Answer": "3P0",
    "Incorrect Answer 1": "1S0",
    "Incorrect Answer 2": "3P2",
    "Incorrect Answer 3": "1D2",
  },
]
MMLU_PRO = [  # TIGER-Lab/MMLU-Pro test parquet (hand-written rows)
  {
    "question_id": 70001,
    "question": "What is the SI unit of force?",
    "options": ["joule", "watt", "pascal", "newton", "tesla", "coulomb", "henry", "volt", "ohm", "weber"],
    "answer": "D",
    "answer_index": 3,
    "cot_content": "",
    "category": "physics",
    "src": "hand-written",
  },
  {
    "question_id": 70002,
    "question": "Which is a prime number?",
    "options": ["4", "6", "7", "9"],  # MMLU-Pro rows can have fewer than 10 options
    "answer": "C",
    "answer_index": 2,
    "cot_content": "",
    "category": "math",
    "src": "hand-written",
  },
]
IFEVAL = [  # google/IFEval (the first row, key 1000)
  {
    "key": 1000,
    "prompt": 'Write a 300+ word summary of the wikipedia page "https://en.wikipedia.org/wiki/Raymond_III,_Count_of_'
    'Tripoli". Do not use any commas and highlight at least 3 sections that has titles in markdown format, for '
    "example *highlighted section part 1*, *highlighted section part 2*, *highlighted section part 3*.",
    "instruction_id_list": [
      "punctuation:no_comma",
      "detectable_format:number_highlighted_sections",
      "length_constraints:number_words",
    ],
    "kwargs": [{}, {"num_highlights": 3}, {"relation": "at least", "num_words": 300}],
  },
]


def _lcb_private(cases):
  """code_generation_lite's private_test_cases encoding: base64(zlib(pickle(json string)))."""
  import base64
  import json
  import pickle
  import zlib

  return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LIVECODEBENCH = [  # livecodebench/code_generation_lite test*.jsonl fields (hand-written rows)
  {
    "question_title": "Add Two",
    "question_content": "You are given two integers A and B. Print A+B.\n\nInput\n\nA B\n\nOutput\n\nPrint the sum.",
    "platform": "atcoder",
    "question_id": "abc999_a",
    "contest_id": "abc999",
    "contest_date": "2024-09-14T00:00:00",
    "starter_code": "",
    "difficulty": "easy",
    "public_test_cases": '[{"input": "1 2\\n", "output": "3\\n", "testtype": "stdin"}]',
    "private_test_cases": _lcb_private([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"}]),
    "metadata": "{}",
  },
  {
    "question_title": "max-of-array",
    "question_content": "Given an integer array nums, return its largest element.",
    "platform": "leetcode",
    "question_id": "9001",
    "contest_id": "weekly-contest-999",
    "contest_date": "2023-05-20T00:00:00",
    "starter_code": "class Solution:\n    def maxOf(self, nums: List[int]) -> int:\n        ",
    "difficulty": "easy",
    "public_test_cases": '[{"input": "[1, 5, 2]", "output": "5", "testtype": "functional"}]',
    "private_test_cases": _lcb_private([{"input": "[-3, -1]", "output": "-1", "testtype": "functional"}]),
    "metadata": '{"func_name": "maxOf"}',
  },
]


# evalplus/humanevalplus-release HumanEvalPlus.jsonl and evalplus/mbppplus-release MbppPlus.jsonl fields; the
# prompts, canonical solutions and base inputs are the published ones, the plus inputs a few of the kind EvalPlus
# generates (edge values and the type-aware mutations of the base inputs).
HUMANEVAL_PLUS = [
  {
    "task_id": "HumanEval/0",
    "prompt": (
      "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
      '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
      "    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
      '    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n'
    ),
    "contract": (
      '\n    assert isinstance(threshold, float) and threshold > 0, "invalid inputs" # $_CONTRACT_$\n'
      '    assert isinstance(numbers, list), "invalid inputs" # $_CONTRACT_$\n'
    ),
    "canonical_solution": (
      "\n    sorted_numbers = sorted(numbers)\n    for i in range(len(sorted_numbers) - 1):\n"
      "        if sorted_numbers[i + 1] - sorted_numbers[i] < threshold:\n            return True\n"
      "    return False\n\n"
    ),
    "entry_point": "has_close_elements",
    "base_input": [
      [[1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3],
      [[1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05],
      [[1.0, 2.0, 5.9, 4.0, 5.0], 0.95],
      [[1.0, 2.0, 5.9, 4.0, 5.0], 0.8],
      [[1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1],
      [[1.1, 2.2, 3.1, 4.1, 5.1], 1.0],
      [[1.1, 2.2, 3.1, 4.1, 5.1], 0.5],
    ],
    "plus_input": [[[1.0, 2.5, 4.0, 5.5], 1.5], [[], 0.1], [[7.0], 3.2], [[3.0, 1.0, 2.0, 5.0], 1.0]],
    "atol": 0,
  },
  {
    "task_id": "HumanEval/2",
    "prompt": (
      'def truncate_number(number: float) -> float:\n    """ Given a positive floating point number, it can be '
      "decomposed into\n    and integer part (largest integer smaller than given number) and decimals\n"
      "    (leftover part always smaller than 1).\n\n    Return the decimal part of the number.\n"
      '    >>> truncate_number(3.5)\n    0.5\n    """\n'
    ),
    "contract": '\n    assert number > 0, "invalid inputs" # $_CONTRACT_$\n',
    "canonical_solution": "\n    return number - int(number)\n\n",
    "entry_point": "truncate_number",
    "base_input": [[3.5], [1.33], [123.456]],
    "plus_input": [[999.99999], [0.04363], [3.14159], [1e-05], [2.0]],
    "atol": 1e-06,
  },
]
MBPP_PLUS = [
  {
    "task_id": "Mbpp/2",
    "code": "def similar_elements(test_tup1, test_tup2):\n  return tuple(set(test_tup1) & set(test_tup2))",
    "prompt": (
      '"""\nWrite a function to find the shared elements from the given two lists.\n'
      'assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"""\n'
    ),
    "entry_point": "similar_elements",
    "canonical_solution": "\ndef similar_elements(test_tup1, test_tup2):\n  return tuple(set(test_tup1) & set(test_tup2))\n",
    "base_input": [[[3, 4, 5, 6], [5, 7, 4, 10]], [[1, 2, 3, 4], [5, 4, 3, 7]], [[11, 12, 14, 13], [17, 15, 14, 13]]],
    "plus_input": [[[], []], [[1, 2, 3], []], [[1, 2, 2, 3], [2, 2, 4]]],
    "atol": 0,
    "assertion": (
      "\nassert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"
      "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))\n"
      "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))\n"
    ),
  },
  {
    "task_id": "Mbpp/3",
    "code": (
      "import math\ndef is_not_prime(n):\n    result = False\n    for i in range(2,int(math.sqrt(n)) + 1):\n"
      "        if n % i == 0:\n            result = True\n    return result"
    ),
    "prompt": '"""\nWrite a python function to identify non-prime numbers.\nassert is_not_prime(2) == False\n"""\n',
    "entry_point": "is_not_prime",
    "canonical_solution": (
      "\nimport math\ndef is_not_prime(n):\n    if n == 1:\n        return True\n"
      "    for i in range(2, int(math.sqrt(n))+1):\n        if n % i == 0:\n            return True\n"
      "    return False\n"
    ),
    "base_input": [[2], [10], [35], [37]],
    "plus_input": [[1], [7919], [49], [1000003]],
    "atol": 0,
    "assertion": (
      "\nassert is_not_prime(2) == False\nassert is_not_prime(10) == True\nassert is_not_prime(35) == True\n"
      "assert is_not_prime(37) == False\n"
    ),
  },
  {
    "task_id": "Mbpp/786",
    "code": "import re\ndef text_match_three(text):\n    return re.search('ab{3}?', text)",
    "prompt": (
      '"""\nWrite a function that matches a string that has an a followed by three \'b\'.\n'
      'assert not text_match_three("ac")\n"""\n'
    ),
    "entry_point": "text_match_three",
    "canonical_solution": "\nimport re\ndef text_match_three(text):\n    patterns = 'ab{3}?'\n    return re.search(patterns,  text)\n",
    "base_input": [["ac"], ["dc"], ["abbbba"], ["caacabbbba"]],
    "plus_input": [[""], ["abbb"], ["bbbba"]],
    "atol": 0,
    "assertion": '\nassert not text_match_three("ac")\nassert not text_match_three("dc")\n',
  },
]
