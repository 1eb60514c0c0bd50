"""The built-in synthetic domains: a prompt generator and exact verifier each.

Four training domains stand in for the expert domains of the research setting
(``add`` and ``chain`` are related arithmetic, ``chain`` being the long one;
``instruct`` is concise instruction following; ``sort`` is unrelated) and one
held-out domain (``reverse``) is learned only in base training, so that a drop
on it reveals forgetting. Every prompt starts with a keyword of its domain and
uses only the character tokenizer's alphabet.

Train, validation and test prompts are told apart by a stable hash of the
prompt text (``split_of``), so no two splits share a prompt, however many
examples either one draws. Validation is for choices made during or between
runs (when the base stops, merge settings); test is only ever reported.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import string
import zlib

import numpy as np

from mopd_jax.errors import DataError

# The order fixes each split's random stream (its index): validation came
# last so that the train and test streams stayed what they were.
SPLITS = ("train", "test", "validation")
HELD_OUT_SPLITS = ("test", "validation")  # unique prompts, graded
TEST_FRACTION = 0.1
VALIDATION_FRACTION = 0.1

# Reference integers are small; capping the digits keeps a verifier from
# spending quadratic time in int() (or hitting Python's 4300-digit limit) on a
# completion such as '9' * 10000.
_INT_PATTERN = re.compile(r"[+-]?[0-9]{1,18}")

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


def _parse_int(text: str) -> int | None:
  """The integer spelled by ``text`` (whitespace around allowed), or None."""
  match = _INT_PATTERN.fullmatch(text.strip())
  return int(match.group()) if match else None


def _exact(completion: str, answer: str) -> float:
  # Surrounding whitespace is not part of the answer; anything else is.
  return float(completion.strip() == answer.strip())


def _letters(rng: np.random.Generator, low: int, high: int) -> str:
  """A random lowercase word whose length is uniform in [low, high]."""
  size = int(rng.integers(low, high + 1))
  return "".join(string.ascii_lowercase[i] for i in rng.integers(0, 26, size))


class _ExactMatch(Domain):
  """A domain whose reward is 1.0 iff the completion is the answer."""

  def verify(self, completion: str, answer: str) -> float:
    return _exact(completion, answer)


class _Add(_ExactMatch):
  """``add 47+85=`` -> ``132``, operands uniform in 0..99."""

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    a, b = (int(x) for x in rng.integers(0, 100, 2))
    return f"add {a}+{b}=", str(a + b)


class _Chain(Domain):
  """``sum 12 7 30 5:`` -> ``12+7=19;19+30=49;49+5=54;#54``.

  Only the outcome is verified, like a math verifier: the text after the last
  ``#`` must be the correct total, whatever the steps before it say.
  """

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    num_terms = int(rng.integers(3, 6))
    terms = [int(x) for x in rng.integers(1, 50, num_terms)]
    steps, total = [], terms[0]
    for term in terms[1:]:
      steps.append(f"{total}+{term}={total + term};")
      total += term
    prompt = "sum " + " ".join(str(t) for t in terms) + ":"
    return prompt, "".join(steps) + f"#{total}"

  def verify(self, completion: str, answer: str) -> float:
    if "#" not in completion:
      return 0.0
    expected = _parse_int(answer.rpartition("#")[2])
    got = _parse_int(completion.rpartition("#")[2])
    return float(expected is not None and got == expected)


class _Instruct(_ExactMatch):
  """Concise instructions on a 4 to 8 letter word; answers are 1 to 3 letters.

  ``first 2 of kqzt:`` -> ``kq``, ``last 1 of kqzt:`` -> ``t``,
  ``letter 3 of kqzt:`` -> ``z``.
  """

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    word = _letters(rng, 4, 8)
    task = int(rng.integers(0, 3))
    if task == 0:
      k = int(rng.integers(1, 4))
      return f"first {k} of {word}:", word[:k]
    if task == 1:
      k = int(rng.integers(1, 4))
      return f"last {k} of {word}:", word[-k:]
    i = int(rng.integers(1, 5))
    return f"letter {i} of {word}:", word[i - 1]


class _Sort(_ExactMatch):
  """``sort qbfa:`` -> ``abfq``, 4 to 7 letters; no partial credit."""

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    word = _letters(rng, 4, 7)
    return f"sort {word}:", "".join(sorted(word))


class _Reverse(_ExactMatch):
  """``rev abcd:`` -> ``dcba``, 3 to 5 letters."""

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    word = _letters(rng, 3, 5)
    return f"rev {word}:", word[::-1]


DOMAINS: dict[str, Domain] = {
    d.name: d for d in (
        _Add("add", False, "two-operand addition, operands 0..99", 3),
        _Chain("chain", False,
               "step-by-step sum of 3 to 5 terms; only the total is checked",
               45),
        _Instruct("instruct", False,
                  "first/last k letters, the i-th letter", 3),
        _Sort("sort", False, "sort 4 to 7 letters", 7),
        _Reverse("reverse", True,
                 "reverse 3 to 5 letters; held out, base training only", 5),
    )
}
TRAIN_DOMAINS: tuple[str, ...] = ("add", "chain", "instruct", "sort")
HELD_OUT_DOMAINS: tuple[str, ...] = ("reverse",)


def get_domain(name: str) -> Domain:
  """The built-in domain called ``name``, or the file domain it names
  (``<kind>:<path>``, ``data/files.py``)."""
  from mopd_jax.data import files  # files builds on this module
  if files.is_file_domain(name):
    return files.file_domain(name)
  try:
    return DOMAINS[name]
  except KeyError:
    raise DataError(
        f"unknown domain {name!r}; known: {', '.join(DOMAINS)}, or a file"
        f" as {'|'.join(files.REWARDS)}:<path>") from None


def completion_budget(domains, cap: int) -> int:
  """Tokens a training rollout of these domains' prompts may take:
  ``min(cap, 2 L + 2)``, ``L`` the longest answer of ``domains`` in
  characters, which bounds its tokens: room for the answer, its EOS and as
  much again for a wrong one. Without it an ``add`` expert would sample and
  train on rows of ``cap`` = 48 tokens whose answers take at most 4."""
  return min(cap, 2 * max(get_domain(d).answer_chars for d in domains) + 2)


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


def generate(domain: str, split: str, n: int, seed: int) -> list[Example]:
  """``n`` examples of ``domain`` whose prompts belong to ``split``.

  Deterministic in its arguments. Train examples may repeat a prompt; test
  and validation prompts are unique, so that accuracy counts each prompt
  once. Drawing
  from one stream and keeping the order makes a smaller ``n`` a prefix of a
  larger one.
  """
  spec = get_domain(domain)
  if split not in SPLITS:
    raise DataError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
  if n < 0 or seed < 0:
    raise DataError(f"need n >= 0 and seed >= 0, got n={n}, seed={seed}")
  return spec.draw(split, n, seed)
