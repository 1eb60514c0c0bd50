"""Two small data files for a real checkpoint, written from templates with
exact answers (nothing downloaded):

    python experiments/real_data.py --out=data/real [--n=300]

* ``sums.jsonl`` (kind ``math``): arithmetic word problems, GSM8K's
  format (``{"question", "answer"}``, the final answer after ``####``),
  graded by math-verify;
* ``constraints.jsonl`` (kind ``constraints``): IFEval-style instructions
  (``{"prompt", "instruction_id_list", "kwargs"}``, IFEval's ids and
  kwargs), graded by if-verifiable.

Use them as ``math:<out>/sums.jsonl`` and
``constraints:<out>/constraints.jsonl`` wherever a domain is named.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

NAMES = ("Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo")
ITEMS = ("apples", "books", "coins", "stamps", "marbles", "pencils")
STORIES = (
    ("{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?",
     lambda a, b: a + b, "{a} + {b} = {c}"),
    ("{n} had {a} {i} and gave {b} of them away. How many {i} are left?",
     lambda a, b: a - b, "{a} - {b} = {c}"),
    ("{n} packs {a} boxes with {b} {i} in each box. How many {i} is that"
     " in all?", lambda a, b: a * b, "{a} * {b} = {c}"),
)
TOPICS = ("the sea", "a train journey", "autumn", "a small town", "music",
          "gardening", "the moon", "a rainy day")
# IFEval instruction ids with their kwargs (none needs NLTK data).
INSTRUCTIONS = (
    ("change_case:english_lowercase", {},
     "Your entire response must be in lowercase letters."),
    ("change_case:english_capital", {},
     "Your entire response must be in capital letters."),
    ("length_constraints:number_words", {"relation": "less than",
                                         "num_words": 30},
     "Answer in fewer than 30 words."),
    ("length_constraints:number_words", {"relation": "at least",
                                         "num_words": 20},
     "Answer in at least 20 words."),
    ("punctuation:no_comma", {}, "Do not use any commas."),
    ("keywords:existence", {"keywords": ["blue"]},
     "Include the word blue."),
    ("detectable_format:title", {},
     "Give your answer a title wrapped in double angular brackets, such as"
     " <<my title>>."),
)


def sums(n: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    story, value, work = STORIES[int(rng.integers(len(STORIES)))]
    a, b = (int(x) for x in rng.integers(2, 60, 2))
    a, b = max(a, b), min(a, b)
    fill = dict(n=NAMES[int(rng.integers(len(NAMES)))],
                i=ITEMS[int(rng.integers(len(ITEMS)))], a=a, b=b,
                c=value(a, b))
    out.append({"question": story.format(**fill),
                "answer": work.format(**fill) + f"\n#### {fill['c']}"})
  return out


def constraints(n: int, seed: int = 1) -> list[dict]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    picks = rng.choice(len(INSTRUCTIONS), size=int(rng.integers(1, 3)),
                       replace=False)
    # lowercase and capitals cannot both hold
    if {0, 1} <= set(int(p) for p in picks):
      picks = picks[:1]
    chosen = [INSTRUCTIONS[int(p)] for p in picks]
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    prompt = f"Write a short note about {topic}. " + " ".join(
        text for _, _, text in chosen)
    out.append({"prompt": prompt,
                "instruction_id_list": [i for i, _, _ in chosen],
                "kwargs": [kwargs for _, kwargs, _ in chosen]})
  return out


def write(out: str, n: int) -> dict[str, str]:
  """Both files under ``out``; ``{kind: path}``."""
  os.makedirs(out, exist_ok=True)
  paths = {}
  for kind, name, records in (("math", "sums", sums(n)),
                              ("constraints", "constraints",
                               constraints(n))):
    path = os.path.join(out, f"{name}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    paths[kind] = path
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--n", type=int, default=300)
  args = parser.parse_args(argv)
  for kind, path in write(args.out, args.n).items():
    print(f"{kind}:{path}")


if __name__ == "__main__":
  main()
