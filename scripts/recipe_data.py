"""The learning recipe's task data (docs/pretraining.md "The whole recipe"): "max of four digits".

A prompt is `max D D D D` (four decimal digits, spaces between them); the answer is the largest digit. Every one
of the 10^4 digit lists is one prompt; a seeded permutation of all of them is cut into three disjoint ranges, so
the splits share no prompt by construction:

  data/recipe/heldout.jsonl    the first HELDOUT lists: `{"id", "prompt", "answer"}` (launch/eval.py answer.exact);
                               never trained on, by SFT or RL
  data/recipe/rl_train.jsonl   the next RL lists: the same fields (an RL `jsonl` task with the exact reward)
  data/recipe/sft_train.jsonl  the next SFT lists as chats: `{"id", "messages": [user, assistant]}`

  python scripts/recipe_data.py            # (re)write data/recipe/
  python scripts/recipe_data.py --check    # exit 1 unless the shipped files are exactly what this generates
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "data", "recipe")
SEED = 20260
DIGITS = 4
HELDOUT, RL, SFT = 200, 1000, 2000
FILES = ("heldout.jsonl", "rl_train.jsonl", "sft_train.jsonl")


def prompt_text(digits) -> str:
  return "max " + " ".join(str(d) for d in digits)


def _lists() -> list[tuple[int, ...]]:
  """All 10^DIGITS digit lists in the seeded order the splits are cut from."""
  order = np.random.default_rng(SEED).permutation(10**DIGITS)
  return [tuple(int(c) for c in f"{int(i):0{DIGITS}d}") for i in order]


def records() -> dict[str, list[dict]]:
  """file name -> its records (deterministic: a function of SEED and the split sizes only)."""
  lists = _lists()
  held, rl, sft = lists[:HELDOUT], lists[HELDOUT : HELDOUT + RL], lists[HELDOUT + RL : HELDOUT + RL + SFT]

  def task(prefix, ds):
    return [{"id": f"{prefix}/{''.join(map(str, d))}", "prompt": prompt_text(d), "answer": str(max(d))} for d in ds]

  chats = [
    {
      "id": f"sft/{''.join(map(str, d))}",
      "messages": [{"role": "user", "content": prompt_text(d)}, {"role": "assistant", "content": str(max(d))}],
    }
    for d in sft
  ]
  return {"heldout.jsonl": task("heldout", held), "rl_train.jsonl": task("rl", rl), "sft_train.jsonl": chats}


def _text(rows: list[dict]) -> str:
  return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=OUT, help="output directory (default: data/recipe)")
  ap.add_argument("--check", action="store_true", help="compare the files in --out with what this generates")
  args = ap.parse_args(argv)
  want = {name: _text(rows) for name, rows in records().items()}
  if args.check:
    bad = []
    for name, text in want.items():
      path = os.path.join(args.out, name)
      if not os.path.isfile(path) or _read(path) != text:
        bad.append(path)
    if bad:
      print(f"recipe_data: differ from the generator: {bad}", file=sys.stderr)
      return 1
    print(f"recipe_data: {args.out} matches ({', '.join(FILES)})")
    return 0
  os.makedirs(args.out, exist_ok=True)
  for name, text in want.items():
    with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
      f.write(text)
  print(f"recipe_data: wrote {', '.join(f'{n} ({len(records()[n])})' for n in FILES)} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
