"""The built-in synthetic domains: a prompt generator and exact verifier each.

Four training domains stand in for the expert domains of the research setting
(``add`` and ``chain`` are related arithmetic, ``chain`` being the long one;
``instruct`` is concise instruction following; ``sort`` is unrelated) and one
held-out domain (``reverse``) is learned only in base training, so that a drop
on it reveals forgetting. Every prompt starts with a keyword of its domain and
uses only the character tokenizer's alphabet.

Splits and the ``Domain`` contract are in ``example``; ``get_domain``
resolves a name to a built-in domain or to a file's (``files``).
"""

from __future__ import annotations

import re
import string

import numpy as np

from mopd_jax.data import files
from mopd_jax.data.example import SPLITS, Domain, Example
from mopd_jax.errors import DataError

# Reference integers are small; capping the digits keeps a verifier from
# spending quadratic time in int() (or hitting Python's 4300-digit limit) on a
# completion such as '9' * 10000.
_INT_PATTERN = re.compile(r"[+-]?[0-9]{1,18}")


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


class _Derive(_Chain):
  """``derive 12 7 30:`` -> ``the running total 12 plus 7 is 19; the
  running total 19 plus 30 is 49; #49``: ``chain``'s sums, each step
  written out in words, a long derivation (about 100 tokens, some 35
  times ``instruct``'s answers) of the same arithmetic; only the total is
  checked. Not a default domain: the imbalanced study's long one."""

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    num_terms = int(rng.integers(3, 6))
    terms = [int(x) for x in rng.integers(1, 50, num_terms)]
    steps, total = [], terms[0]
    for term in terms[1:]:
      steps.append(f"the running total {total} plus {term} is"
                   f" {total + term}; ")
      total += term
    prompt = "derive " + " ".join(str(t) for t in terms) + ":"
    return prompt, "".join(steps) + f"#{total}"


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
# Built-in domains outside the default five (each study variant that uses
# one names it in its domains; the default base never sees it).
EXTRA_DOMAINS: dict[str, Domain] = {
    d.name: d for d in (
        _Derive("derive", False, "chain's 3 to 5 terms, each step in words;"
                " only the total is checked", 160),
    )
}


def get_domain(name: str) -> Domain:
  """The built-in domain called ``name``, or the file domain it names
  (``<kind>:<path>``, ``data/files.py``)."""
  if files.is_file_domain(name):
    return files.file_domain(name)
  try:
    return DOMAINS[name] if name in DOMAINS else EXTRA_DOMAINS[name]
  except KeyError:
    raise DataError(
        f"unknown domain {name!r}; known:"
        f" {', '.join((*DOMAINS, *EXTRA_DOMAINS))}, or a file"
        f" as {'|'.join(files.REWARDS)}:<path>") from None


def is_domain(name) -> bool:
  """A built-in domain's name or a file domain's ``<kind>:<path>``."""
  return name in DOMAINS or name in EXTRA_DOMAINS or (
      isinstance(name, str) and files.is_file_domain(name))


def completion_budget(domains, cap: int) -> int:
  """Tokens a training rollout of these domains' prompts may take:
  ``min(cap, 2 L + 2)``, ``L`` the longest answer of ``domains`` in
  characters, which bounds its tokens: room for the answer, its EOS and as
  much again for a wrong one. Without it an ``add`` expert would sample and
  train on rows of ``cap`` = 48 tokens whose answers take at most 4."""
  return min(cap, 2 * max(get_domain(d).answer_chars for d in domains) + 2)


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
