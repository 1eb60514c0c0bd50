"""Domains from the user's own files: ``<kind>:<path>`` names a JSONL or
Parquet file whose records become a domain with the verifier of ``kind``,
usable wherever a built-in domain name is (``data.domains``, an expert's
``domain``, the teachers' ``{domain}`` template, the study):

* ``math``: ``{"prompt" or "question", "answer"}`` (GSM8K / MATH style).
  The final answer of a text is the last ``\\boxed{...}``, else what follows
  the last ``####``, else the last number. Graded with ``math-verify``
  (a dependency, so every machine grades alike), by exact match after
  normalisation when it cannot parse an answer (commas, ``$``, a trailing
  period and surrounding spaces dropped; numbers compared as numbers).
* ``choice``: ``{"prompt" or "question", "answer": a letter}`` with an
  optional ``"choices"`` list, appended to the prompt as ``A. ...`` lines.
  The answer is the first standalone capital letter of the completion
  after the last ``answer``, else its first standalone capital letter.
* ``constraints``: instruction following, the reward 1 when every
  constraint holds. IFEval's records (``{"prompt", "instruction_id_list",
  "kwargs"}``), or ``{"prompt", "constraints": [{"type": ..., ...}]}``
  where a type is an IFEval instruction id (``change_case:
  english_lowercase``, ``length_constraints:number_words`` with its
  kwargs, ...: checked strictly by ``if-verifiable``, the IFEval and
  IFBench verifiers) or one of this module's ``CHECKS`` (exact checks
  IFEval has no counterpart for: character counts, an exact bullet count,
  lower or upper case without IFEval's English-language test).

A record's split is the stable hash of its prompt (``example.split_of``),
as for the built-in domains. Every record is checked when the file is
first read (``path:line: what is wrong``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from fractions import Fraction

import numpy as np

from mopd_jax.data import example
from mopd_jax.data.records import json_records
from mopd_jax.errors import DataError


def _words(text: str) -> int:
  return len(text.split())


def _bullets(text: str) -> int:
  return sum(1 for line in text.splitlines()
             if line.lstrip().startswith(("- ", "* ")))


def _is_json(text: str) -> bool:
  try:
    json.loads(text)
  except ValueError:
    return False
  return True


# Each checker: (its argument's name or None, check(completion, argument)).
CHECKS = {
    "min_words": ("value", lambda c, v: _words(c) >= v),
    "max_words": ("value", lambda c, v: _words(c) <= v),
    "min_chars": ("value", lambda c, v: len(c) >= v),
    "max_chars": ("value", lambda c, v: len(c) <= v),
    "include": ("keywords",
                lambda c, ks: all(k.lower() in c.lower() for k in ks)),
    "exclude": ("keywords",
                lambda c, ks: not any(k.lower() in c.lower() for k in ks)),
    "lowercase": (None, lambda c, _: c == c.lower()),
    "uppercase": (None, lambda c, _: c == c.upper()),
    "json": (None, lambda c, _: _is_json(c)),
    "bullets": ("count", lambda c, n: _bullets(c) == n),
}

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_LETTER = re.compile(r"\b([A-J])\b")


def final_answer(text: str) -> str:
  """The last ``\\boxed{...}`` (braces balanced), else what follows the
  last ``####``, else the last number, else the stripped text."""
  start = text.rfind("\\boxed{")
  if start >= 0:
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
      depth += {"{": 1, "}": -1}.get(text[j], 0)
      if depth == 0:
        return text[i:j].strip()
  if "####" in text:
    return text.rsplit("####", 1)[1].strip()
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else text.strip()


def _normal(answer: str):
  """A number when ``answer`` reads as one, else the cleaned string."""
  text = answer.replace(",", "").replace("$", "").strip().rstrip(".")
  try:
    return Fraction(text)
  except (ValueError, ZeroDivisionError):
    return text


@functools.cache
def _math_verify():
  """``math_verify``'s ``(parse, verify)``, imported on first use (it
  brings sympy, which a run on the built-in domains does not need)."""
  from math_verify import parse, verify
  return parse, verify


def math_reward(completion: str, answer: str) -> float:
  """1 when the completion's final answer equals the reference's: as
  ``math-verify`` judges them (``\\frac{1}{2}`` equals ``0.5``,
  ``2\\sqrt{2}`` equals ``\\sqrt{8}``), or by exact match after
  normalisation when it cannot parse one of them."""
  mine, ref = final_answer(completion), final_answer(answer)
  exact = float(_normal(mine) == _normal(ref))
  parse, verify = _math_verify()
  try:
    gold, pred = parse(f"${ref}$"), parse(f"${mine}$")
    return float(bool(verify(gold, pred))) if gold and pred else exact
  except Exception:  # pylint: disable=broad-except
    return exact


def choice_letter(text: str) -> str:
  """The chosen letter (module docstring), or ''."""
  after = text.lower().rfind("answer")
  found = _LETTER.search(text[after:]) if after >= 0 else None
  found = found or _LETTER.search(text)
  return found.group(1) if found else ""


def choice_reward(completion: str, answer: str) -> float:
  return float(choice_letter(completion) == answer.strip())


@functools.cache
def _ifeval_instructions() -> dict:
  """IFEval's instruction checkers (``if-verifiable``), imported on first
  use, with langdetect seeded so that its language checks repeat."""
  import langdetect
  from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
  langdetect.DetectorFactory.seed = 0
  return INSTRUCTION_DICT


def _ifeval_holds(completion: str, prompt: str, constraints) -> bool:
  """Whether every IFEval constraint holds strictly (``if-verifiable``'s
  ``binary_strict``)."""
  from if_verifiable.common import evaluate_instructions
  ids = [c["type"] for c in constraints]
  kwargs = [{k: v for k, v in c.items() if k != "type"} for c in constraints]
  _, scores = evaluate_instructions(completion, ids, kwargs, prompt,
                                    _ifeval_instructions())
  return scores.binary_strict == 1.0


def constraints_reward(completion: str, answer: str) -> float:
  """1 when every constraint holds (``answer``: the JSON list of them, or
  ``{"prompt", "constraints"}`` when IFEval's need the prompt)."""
  record = json.loads(answer)
  prompt, constraints = (("", record) if isinstance(record, list)
                         else (record["prompt"], record["constraints"]))
  ours = [c for c in constraints if c["type"] in CHECKS]
  theirs = [c for c in constraints if c["type"] not in CHECKS]
  return float(all(CHECKS[c["type"]][1](completion, c.get(
      CHECKS[c["type"]][0])) for c in ours) and (
          not theirs or _ifeval_holds(completion, prompt, theirs)))


REWARDS = {"math": math_reward, "choice": choice_reward,
           "constraints": constraints_reward}


def is_file_domain(name: str) -> bool:
  return name.split(":", 1)[0] in REWARDS and ":" in name


def label(name: str) -> str:
  """A domain's name as a file or folder name: a built-in name as it is,
  ``<kind>:<path>`` as ``<kind>_<file stem>`` (``math:/d/gsm8k.jsonl`` ->
  ``math_gsm8k``)."""
  if not is_file_domain(name):
    return name
  kind, path = name.split(":", 1)
  return f"{kind}_{os.path.splitext(os.path.basename(path))[0]}"


@dataclasses.dataclass(frozen=True)
class FileDomain(example.Domain):
  """The records of one file, with the verifier of their kind."""
  kind: str = "math"
  records: tuple = ()

  def _sample(self, rng: np.random.Generator) -> tuple[str, str]:
    e = self.records[int(rng.integers(len(self.records)))]
    return e.prompt, e.answer

  def verify(self, completion: str, answer: str) -> float:
    return REWARDS[self.kind](completion, answer)

  def draw(self, split: str, n: int, seed: int) -> list[example.Example]:
    """``n`` examples of ``split``: for train drawn with replacement; for
    the held-out splits the first ``n`` of a seeded order of its unique
    prompts, or all of them when there are fewer."""
    mine = [e for e in self.records if example.split_of(e.prompt) == split]
    if not mine:
      raise DataError(f"{self.name}: no {split} records (a record's split is"
                      " the hash of its prompt; the file needs more lines)")
    rng = np.random.default_rng([seed, example.SPLITS.index(split)])
    if split in example.HELD_OUT_SPLITS:
      unique = list({e.prompt: e for e in mine}.values())
      return [unique[i] for i in rng.permutation(len(unique))[:n]]
    return [mine[i] for i in rng.integers(len(mine), size=n)]


def _read(path: str) -> list[tuple[str, dict]]:
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise DataError(f"{path}: reading Parquet needs pyarrow"
                      " (pip install pyarrow)") from None
    try:
      rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"{path}: not a readable Parquet file"
                      f" ({type(e).__name__})") from None
    return [(f"{path}:{i + 1}", row) for i, row in enumerate(rows)]
  return json_records(path)


def _text(record: dict, where: str, *keys: str) -> str:
  for key in keys:
    if key in record:
      if not isinstance(record[key], str) or not record[key].strip():
        raise DataError(f"{where}: field {key!r} must be a non-empty string")
      return record[key]
  raise DataError(f"{where}: missing field " + " or ".join(map(repr, keys)))


def _parse(kind: str, record: dict, where: str, name: str) -> example.Example:
  prompt = _text(record, where, "prompt", "question")
  if kind == "constraints":
    constraints = _constraints(record, where)
    answer = json.dumps({"prompt": prompt, "constraints": constraints})
  else:
    answer = _text(record, where, "answer")
  if kind == "choice":
    choices = record.get("choices", [])
    if not isinstance(choices, list) or not all(
        isinstance(c, str) for c in choices) or len(choices) > 10:
      raise DataError(f"{where}: field 'choices' must be a list of at most"
                      " 10 strings")
    prompt += "".join(f"\n{chr(65 + i)}. {c}" for i, c in enumerate(choices))
    if not re.fullmatch(r"[A-J]", answer.strip()):
      raise DataError(f"{where}: field 'answer' must be one letter A-J,"
                      f" got {answer[:20]!r}")
  if kind == "math" and not ("\\boxed{" in answer or "####" in answer
                              or _NUMBER.search(answer)):
    raise DataError(f"{where}: field 'answer': no final answer in"
                    f" {answer[:40]!r}")
  return example.Example(prompt=prompt, answer=answer, domain=name)


def _constraints(record: dict, where: str) -> list[dict]:
  """The checked constraints of a ``constraints`` record (module
  docstring), IFEval's ``instruction_id_list`` + ``kwargs`` as
  ``{"type": id, **kwargs}``."""
  if "instruction_id_list" in record:
    ids, kwargs = record["instruction_id_list"], record.get("kwargs")
    if not (isinstance(ids, list) and ids and isinstance(kwargs, list)
            and len(kwargs) == len(ids)
            and all(isinstance(k, dict) for k in kwargs)):
      raise DataError(f"{where}: 'instruction_id_list' must be a non-empty"
                      " list with one 'kwargs' object per instruction")
    constraints = [dict({k: v for k, v in kw.items() if v is not None},
                        type=i) for i, kw in zip(ids, kwargs)]
  else:
    constraints = record.get("constraints")
  if not isinstance(constraints, list) or not constraints:
    raise DataError(f"{where}: field 'constraints' must be a non-empty"
                    " list (or IFEval's 'instruction_id_list')")
  for c in constraints:
    if not isinstance(c, dict) or not isinstance(c.get("type"), str):
      raise DataError(f"{where}: constraint {c!r} has no 'type'")
    if c["type"] in CHECKS:
      arg = CHECKS[c["type"]][0]
      if arg and arg not in c:
        raise DataError(f"{where}: constraint {c['type']!r} needs {arg!r}")
    elif c["type"] in _ifeval_instructions():
      _check_ifeval(c, where)
    else:
      raise DataError(f"{where}: constraint {c['type']!r}: 'type' must be"
                      f" an IFEval instruction id or one of"
                      f" {', '.join(CHECKS)}")
  return constraints


def _check_ifeval(constraint: dict, where: str) -> None:
  """An IFEval constraint's kwargs build its checker, and the checker
  runs here (one that needs NLTK data this machine lacks is refused now,
  not at the first reward)."""
  checker = _ifeval_instructions()[constraint["type"]](constraint["type"])
  try:
    checker.build_description(**{k: v for k, v in constraint.items()
                                  if k != "type"})
    checker.check_following("A short test. Of two sentences.")
  except LookupError:
    raise DataError(f"{where}: constraint {constraint['type']!r} needs NLTK"
                    " data this machine does not have (python -m"
                    " nltk.downloader punkt)") from None
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"{where}: constraint {constraint['type']!r}:"
                    f" {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=None)
def file_domain(name: str) -> FileDomain:
  """The domain ``<kind>:<path>``, its file read and checked once."""
  kind, path = name.split(":", 1)
  path = os.path.expanduser(path)
  records = tuple(_parse(kind, record, where, name)
                  for where, record in _read(path))
  if not records:
    raise DataError(f"{path}: no records")
  return FileDomain(
      name=name, held_out=False, kind=kind, records=records,
      description=f"{kind} records of {path}",
      # A user's task may reason before it answers: its completions get
      # sampling.max_new_tokens, not a budget from the answers' length.
      answer_chars=10**6)
