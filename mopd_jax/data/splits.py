"""The built-in domains' splits as a run's config asks for them, and the
user's evaluation file in place of the test splits."""

from __future__ import annotations

import os
from typing import Sequence

from mopd_jax.data import domains, tfds_builder
from mopd_jax.data.domains import get_domain
from mopd_jax.data.files import is_file_domain
from mopd_jax.data.jsonl import load_jsonl
from mopd_jax.models import tokenizer as tokenizer_lib

VALIDATION = "validation"  # the split every choice is made on


def domain_splits(config, names: Sequence[str], split: str) -> dict:
  """``{domain: examples}`` of one split of the built-in TFDS datasets, or
  of the files that file domains name."""
  data_dir = os.path.expanduser(config.data.data_dir)
  for name in names:
    get_domain(name)  # unknown names fail here, with the list of known ones
  count = (config.data.train_examples if split == "train" else
           config.data.test_examples)
  return {name: domains.generate(name, split, count, seed=0)
          if is_file_domain(name) else tfds_builder.load_split(
              name, split, data_dir, num_train=config.data.train_examples,
              num_test=config.data.test_examples) for name in names}


def eval_sets(config, names: Sequence[str]) -> dict:
  """Test examples per domain: the built-in test splits, or the user's
  ``data.eval_jsonl`` file when set."""
  if not config.data.eval_jsonl:
    return domain_splits(config, names, "test")
  sets: dict = {}
  # Only the character tokenizer limits the characters, and counts a
  # prompt's tokens by its length.
  char = isinstance(tokenizer_lib.for_config(config),
                    tokenizer_lib.CharTokenizer)
  for example in load_jsonl(os.path.expanduser(config.data.eval_jsonl),
                            alphabet=tokenizer_lib.ALPHABET if char else None,
                            max_prompt_len=config.data.max_prompt_len):
    sets.setdefault(example.domain, []).append(example)
  return sets
