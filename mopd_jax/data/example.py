"""What every domain is: an ``Example`` (prompt and reference answer), a
``Domain`` (draws examples, verifies completions) and the splits.

Train, validation and test prompts are told apart by a stable hash of the
prompt text (``split_of``), so no two splits share a prompt, however many
examples either one draws. Validation is for choices made during or between
runs (when the base stops, merge settings); test is only ever reported.
The built-in domains are in ``domains``, those read from files in
``files``.
"""

from __future__ import annotations

import abc
import dataclasses
import zlib

import numpy as np

from mopd_jax.errors import DataError

# The order fixes each split's random stream (its index): validation came
# last so that the train and test streams stayed what they were.
SPLITS = ("train", "test", "validation")
HELD_OUT_SPLITS = ("test", "validation")  # unique prompts, graded
TEST_FRACTION = 0.1
VALIDATION_FRACTION = 0.1

# Rejection sampling is bounded so that a split that cannot be filled (too
# few distinct test prompts) fails with an error instead of looping forever.
_MIN_DRAWS = 10_000
_DRAWS_PER_EXAMPLE = 100


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt and its reference demonstration (the target text, no EOS)."""
  prompt: str
  answer: str
  domain: str


@dataclasses.dataclass(frozen=True)
class Domain(abc.ABC):
  """A task: draws prompts with demonstrations and scores completions.

  Subclasses implement ``_sample`` and ``verify``; verifiers take any string
  and return a reward in [0, 1] without raising. ``answer_chars`` bounds
  the length of every answer ``_sample`` draws (``completion_budget``).
  """
  name: str
  held_out: bool
  description: str
  answer_chars: int

  def generate(self, rng: np.random.Generator) -> Example:
    """One random prompt and its demonstration answer."""
    prompt, answer = self._sample(rng)
    return Example(prompt=prompt, answer=answer, domain=self.name)

  @abc.abstractmethod
  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    """A prompt and its demonstration answer."""

  @abc.abstractmethod
  def verify(self, completion: str, answer: str) -> float:
    """Reward of a decoded ``completion`` against the stored ``answer``."""

  def draw(self, split: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of ``split`` (``generate``'s contract): drawn from
    ``generate(rng)`` and kept when their prompt hashes to ``split``."""
    # The domain enters through its name's crc32, not its position in DOMAINS,
    # so that adding a domain never changes another domain's data.
    rng = np.random.default_rng(
        [seed, zlib.crc32(self.name.encode("utf-8")), SPLITS.index(split)])
    examples, seen = [], set()
    max_draws = _MIN_DRAWS + _DRAWS_PER_EXAMPLE * n
    draws = 0
    while len(examples) < n:
      if draws == max_draws:
        raise DataError(
            f"could not draw {n} {split} examples of domain {self.name!r} in"
            f" {max_draws} draws (got {len(examples)}); ask for fewer")
      draws += 1
      example = self.generate(rng)
      if split_of(example.prompt) != split:
        continue
      if split in HELD_OUT_SPLITS:
        if example.prompt in seen:
          continue
        seen.add(example.prompt)
      examples.append(example)
    return examples


def split_of(prompt: str) -> str:
  """'test', 'validation' or 'train' for ``prompt``, from a hash stable
  across runs: ``u = crc32(prompt) / 2^32``; test when ``u < 0.1``,
  validation when ``0.1 <= u < 0.2``, train otherwise."""
  # crc32, unlike hash(), does not change with PYTHONHASHSEED.
  bucket = zlib.crc32(prompt.encode("utf-8")) / 2**32
  if bucket < TEST_FRACTION:
    return "test"
  if bucket < TEST_FRACTION + VALIDATION_FRACTION:
    return "validation"
  return "train"
