"""Tests of the built-in domains: generators, verifiers and splits."""

from __future__ import annotations

import string
import time
import zlib

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from mopd_jax.data import domains, example
from mopd_jax.errors import DataError
from mopd_jax.models.tokenizer import ALPHABET

ALL = tuple(domains.DOMAINS)


def _corrupt(answer: str) -> str:
  """``answer`` with its last character changed to another of its class."""
  last = answer[-1]
  pool = string.digits if last.isdigit() else string.ascii_lowercase
  return answer[:-1] + pool[(pool.index(last) + 1) % len(pool)]


def test_registry():
  assert set(domains.DOMAINS) == {"add", "chain", "instruct", "sort", "reverse"}
  assert domains.TRAIN_DOMAINS == ("add", "chain", "instruct", "sort")
  assert domains.HELD_OUT_DOMAINS == ("reverse",)
  for name, d in domains.DOMAINS.items():
    assert d.name == name
    assert d.held_out == (name in domains.HELD_OUT_DOMAINS)
    assert domains.get_domain(name) is d


def test_unknown_domain_names_the_known_ones():
  with pytest.raises(DataError,
                     match="unknown domain 'mul'; known: add, chain"):
    domains.get_domain("mul")
  with pytest.raises(DataError, match="unknown domain"):
    domains.generate("mul", "train", 1, 0)


def test_unknown_split_and_bad_counts():
  with pytest.raises(DataError, match="unknown split 'dev'"):
    domains.generate("add", "dev", 1, 0)
  with pytest.raises(DataError, match="n >= 0"):
    domains.generate("add", "train", -1, 0)
  with pytest.raises(DataError, match="seed >= 0"):
    domains.generate("add", "train", 1, -1)


@pytest.mark.parametrize("name", ALL)
def test_verifier_accepts_demonstration_rejects_corruption(name):
  d = domains.DOMAINS[name]
  for ex in domains.generate(name, "train", 200, seed=1):
    assert ex.domain == name
    assert d.verify(ex.answer, ex.answer) == 1.0
    assert d.verify(" " + ex.answer + "\n", ex.answer) == 1.0
    assert d.verify(_corrupt(ex.answer), ex.answer) == 0.0
    assert d.verify("", ex.answer) == 0.0


@pytest.mark.parametrize("name", ALL)
def test_prompts_and_answers_use_only_the_alphabet(name):
  allowed = set(ALPHABET)
  for ex in domains.generate(name, "train", 500, seed=2):
    assert set(ex.prompt) <= allowed, ex
    assert set(ex.answer) <= allowed, ex
    assert ex.answer


def test_prompts_start_with_a_domain_keyword():
  keywords = {"add": ("add ",), "chain": ("sum ",),
              "instruct": ("first ", "last ", "letter "),
              "sort": ("sort ",), "reverse": ("rev ",)}
  for name in ALL:
    for ex in domains.generate(name, "train", 200, seed=3):
      assert ex.prompt.startswith(keywords[name]), ex


def test_examples_are_correct():
  for ex in domains.generate("add", "train", 300, seed=4):
    a, b = ex.prompt[len("add "):-1].split("+")
    assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert int(ex.answer) == int(a) + int(b)
  for ex in domains.generate("chain", "train", 300, seed=4):
    terms = [int(t) for t in ex.prompt[len("sum "):-1].split()]
    assert 3 <= len(terms) <= 5 and all(1 <= t <= 49 for t in terms)
    steps, total = ex.answer.split("#")
    assert int(total) == sum(terms)
    assert len(steps.rstrip(";").split(";")) == len(terms) - 1
  for ex in domains.generate("sort", "train", 300, seed=4):
    word = ex.prompt[len("sort "):-1]
    assert 4 <= len(word) <= 7 and ex.answer == "".join(sorted(word))
  for ex in domains.generate("reverse", "train", 300, seed=4):
    word = ex.prompt[len("rev "):-1]
    assert 3 <= len(word) <= 5 and ex.answer == word[::-1]


def test_instruct_examples():
  examples = domains.generate("instruct", "train", 2000, seed=5)
  for ex in examples:
    assert len(ex.answer) in (1, 2, 3), ex
    words = ex.prompt[:-1].split()
    word = words[-1]
    assert 4 <= len(word) <= 8 and words[2] == "of"
    k = int(words[1])
    # Checked through prefix/suffix tests, not the generator's slicing.
    if words[0] == "first":
      assert k in (1, 2, 3) and len(ex.answer) == k
      assert word.startswith(ex.answer)
    elif words[0] == "last":
      assert k in (1, 2, 3) and len(ex.answer) == k
      assert word.endswith(ex.answer)
    else:
      assert words[0] == "letter" and 1 <= k <= 4 and ex.answer == word[k - 1]
  assert len({ex.prompt.split()[0] for ex in examples}) == 3


def test_chain_and_add_verifier_edge_cases():
  chain = domains.get_domain("chain")
  assert chain.verify("12+7=19;19+30=49;49+5=54;#54",
                      "12+7=19;19+30=49;49+5=54;#54") == 1.0
  # Only the outcome after the last '#' counts.
  assert chain.verify("wrong steps #1 #54", "12+7=19;#54") == 1.0
  assert chain.verify("#54;", "12+7=19;#54") == 0.0
  assert chain.verify("54", "12+7=19;#54") == 0.0
  add = domains.get_domain("add")
  assert add.verify("132", "132") == 1.0
  assert add.verify("0132", "132") == 0.0


def test_determinism():
  for name in ALL:
    a = domains.generate(name, "train", 100, seed=7)
    assert a == domains.generate(name, "train", 100, seed=7)
    assert a != domains.generate(name, "train", 100, seed=8)
    # A smaller request is a prefix of a larger one.
    assert domains.generate(name, "test", 20, seed=7) == domains.generate(
        name, "test", 40, seed=7)[:20]


@pytest.mark.parametrize("name", ALL)
def test_splits_share_no_prompt(name):
  prompts = {split: [ex.prompt for ex in domains.generate(name, split, n,
                                                           seed=0)]
             for split, n in (("train", 5000), ("test", 500),
                              ("validation", 500))}
  for split, found in prompts.items():
    assert all(example.split_of(p) == split for p in found), split
  for held_out in ("test", "validation"):  # deduplicated
    assert len(set(prompts[held_out])) == len(prompts[held_out])
  assert not set(prompts["train"]) & set(prompts["test"])
  assert not set(prompts["train"]) & set(prompts["validation"])
  assert not set(prompts["test"]) & set(prompts["validation"])


def test_split_of_is_stable_with_ten_percent_held_out_each():
  assert example.split_of("add 1+2=") == example.split_of("add 1+2=")
  prompts = [f"add {a}+{b}=" for a in range(200) for b in range(200)]
  splits = [example.split_of(p) for p in prompts]
  for split, low, high in (("test", 0.08, 0.12), ("validation", 0.08, 0.12),
                           ("train", 0.76, 0.84)):
    assert low < np.mean([s == split for s in splits]) < high, split
  # Each split by its own crc32 bucket: u < 0.1 test, < 0.2 validation.
  bucket = zlib.crc32(prompts[0].encode()) / 2**32
  assert splits[0] == ("test" if bucket < 0.1 else
                       "validation" if bucket < 0.2 else "train")


def test_test_split_kept_its_stream_when_validation_was_added():
  # The first test prompts of add, seed 0, as they were with two splits.
  rng = np.random.default_rng([0, zlib.crc32(b"add"), 1])
  expected = []
  while len(expected) < 5:
    example = domains.DOMAINS["add"].generate(rng)
    bucket = zlib.crc32(example.prompt.encode()) / 2**32
    if bucket < 0.1 and example.prompt not in expected:
      expected.append(example.prompt)
  assert [e.prompt for e in domains.generate("add", "test", 5, 0)] == expected


def test_generate_fails_instead_of_looping_when_split_cannot_fill(monkeypatch):
  monkeypatch.setattr(example, "_MIN_DRAWS", 0)
  monkeypatch.setattr(example, "_DRAWS_PER_EXAMPLE", 2)
  # About 10% of prompts are test prompts, so 2 draws per example fall short.
  with pytest.raises(DataError, match="could not draw 50 test examples"):
    domains.generate("add", "test", 50, seed=0)


def test_chain_answers_are_much_longer_than_instruct_answers():
  mean = {name: np.mean([len(ex.answer)
                         for ex in domains.generate(name, "train", 2000, 0)])
          for name in ("chain", "instruct")}
  assert mean["chain"] >= 5 * mean["instruct"], mean


_NASTY_TEXT = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(), min_size=1000, max_size=5000),
    st.text(alphabet="0123456789#+- ;", max_size=200),
    st.integers(min_value=1, max_value=100_000).map(lambda k: "9" * k),
    st.integers(min_value=1, max_value=100_000).map(lambda k: "#" + "9" * k),
    st.integers(min_value=1, max_value=100_000).map(lambda k: "\x00\n#" * k),
    # Signs, non-ASCII digits (Arabic-Indic, full-width), bidi and escape
    # characters, float spellings, mixed.
    st.lists(st.sampled_from(
        ["#", "-", "+", "9", " ", "\x1b[2J", "\u202e", "\ufeff", "\U0001f600",
         "\u0661\u0662", "\uff11\uff12", "1e999", "nan", "inf", "\r\n"]),
             max_size=60).map("".join),
)


@pytest.mark.parametrize("name", ALL)
@hypothesis.settings(max_examples=100, deadline=2000)
@hypothesis.given(completion=_NASTY_TEXT, answer=_NASTY_TEXT)
def test_verifiers_never_raise(name, completion, answer):
  d = domains.DOMAINS[name]
  reference = d.generate(np.random.default_rng(0)).answer
  for c, a in ((completion, answer), (completion, "12+7=19;#19"),
               (completion, "132"), (completion, reference)):
    start = time.perf_counter()
    reward = d.verify(c, a)
    assert type(reward) is float and 0.0 <= reward <= 1.0
    assert time.perf_counter() - start < 0.5  # never hangs


@pytest.mark.parametrize("name", ALL)
def test_answer_chars_is_the_longest_answer(name):
  """The declared bound holds for every drawn answer and is reached (a
  loose bound would waste decode steps, a short one truncate answers)."""
  drawn = domains.generate(name, "train", 3000, seed=0) + domains.generate(
      name, "test", 200, seed=0)
  longest = max(len(ex.answer) for ex in drawn)
  assert longest == domains.DOMAINS[name].answer_chars


def test_completion_budget():
  assert domains.completion_budget(("add",), 48) == 2 * 3 + 2
  assert domains.completion_budget(("add", "sort"), 48) == 2 * 7 + 2
  assert domains.completion_budget(("add", "chain"), 48) == 48  # the cap
  assert domains.completion_budget(("add",), 5) == 5


def test_derive_is_chain_written_out_about_40_times_instructs_length():
  """The imbalanced study's long domain: chain's arithmetic, each step in
  words, answers 30-50 times as long as instruct's (tokens with EOS, the
  character tokenizer's), its verifier reading only the total; not one of
  the default five."""
  derive = domains.generate("derive", "train", 500, seed=0)
  instruct = domains.generate("instruct", "train", 500, seed=0)
  ratio = (np.mean([len(e.answer) + 1 for e in derive])
           / np.mean([len(e.answer) + 1 for e in instruct]))
  assert 30 < ratio < 50, ratio
  spec = domains.get_domain("derive")
  assert all(spec.verify(e.answer, e.answer) == 1.0 for e in derive)
  e = derive[0]
  assert spec.verify("wrong words #" + e.answer.rpartition("#")[2],
                     e.answer) == 1.0
  total = int(e.answer.rpartition("#")[2])
  assert spec.verify(e.answer.rpartition("#")[0] + f"#{total + 1}",
                     e.answer) == 0.0
  assert max(len(e.answer) for e in derive) <= spec.answer_chars
  assert "derive" not in domains.DOMAINS and domains.is_domain("derive")
