"""Domains from the user's files: the verifiers against hand-worked cases,
the splits, bad records named by file and line, and a GRPO run on a file
domain end to end."""

import json

import pytest

from conftest import math_file
from mopd_jax.data import domains, example, files
from mopd_jax.errors import DataError


@pytest.mark.parametrize("text,want", [
    ("so x = \\boxed{\\frac{1}{2}} and then \\boxed{3}", "3"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("48 + 24 = 72 clips\n#### 72", "72"),
    ("first 3 then 1,250 apples", "1,250"),
    ("no number here", "no number here"),
])
def test_final_answer(text, want):
  assert files.final_answer(text) == want


@pytest.mark.parametrize("completion,answer,want", [
    ("the total is 1,000.", "#### 1000", 1.0),
    ("$0.5", "1/2", 1.0),
    ("it is 72", "72", 1.0),
    ("it is 71", "72", 0.0),
    ("\\boxed{x+1}", "\\boxed{x+1}", 1.0),
    ("", "72", 0.0),
    # math-verify's equivalences, beyond exact match
    ("so \\boxed{\\frac{1}{2}}", "#### 0.5", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{8}}", 1.0),
    ("\\boxed{x+1}", "\\boxed{1+x}", 1.0),
    ("\\boxed{x+2}", "\\boxed{1+x}", 0.0),
])
def test_math_reward(completion, answer, want):
  assert files.math_reward(completion, answer) == want


@pytest.mark.parametrize("completion,letter", [
    ("B", "B"), ("I think A is wrong; the answer is (C).", "C"),
    ("Answer: D", "D"), ("none", ""), ("A and B", "A")])
def test_choice_letter(completion, letter):
  assert files.choice_letter(completion) == letter


@pytest.mark.parametrize("constraint,good,bad", [
    ({"type": "min_words", "value": 3}, "one two three", "one two"),
    ({"type": "max_words", "value": 2}, "one two", "one two three"),
    ({"type": "min_chars", "value": 4}, "abcd", "abc"),
    ({"type": "max_chars", "value": 3}, "abc", "abcd"),
    ({"type": "include", "keywords": ["cat", "Dog"]}, "a dog and a CAT",
     "a cat"),
    ({"type": "exclude", "keywords": ["cat"]}, "a dog", "a Cat"),
    ({"type": "lowercase"}, "all low", "Not low"),
    ({"type": "uppercase"}, "ALL HIGH", "Not high"),
    ({"type": "json"}, '{"a": 1}', "{a: 1}"),
    ({"type": "bullets", "count": 2}, "- one\n* two\nthree", "- one"),
])
def test_each_constraint(constraint, good, bad):
  answer = json.dumps([constraint])
  assert files.constraints_reward(good, answer) == 1.0
  assert files.constraints_reward(bad, answer) == 0.0


def test_a_file_domain_splits_and_draws(tmp_path):
  name = "math:" + math_file(tmp_path / "m.jsonl")
  spec = domains.get_domain(name)
  assert spec.verify("so 12", "#### 12") == 1.0
  test = domains.generate(name, "test", 1000, seed=0)
  validation = domains.generate(name, "validation", 5, seed=0)
  train = domains.generate(name, "train", 50, seed=0)
  assert len({e.prompt for e in test}) == len(test) < 100  # all there are
  assert all(example.split_of(e.prompt) == s for s, part in
             (("test", test), ("validation", validation), ("train", train))
             for e in part)
  assert domains.generate(name, "train", 50, seed=0) == train
  assert domains.generate(name, "test", 3, seed=0) == test[:3]


def test_choices_are_appended_and_parquet_reads(tmp_path):
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa
  rows = [{"question": f"pick {i}", "choices": ["x", "y"], "answer": "B"}
          for i in range(40)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
  spec = domains.get_domain(f"choice:{tmp_path / 'c.parquet'}")
  assert spec.records[0].prompt == "pick 0\nA. x\nB. y"
  assert spec.verify("the answer is B", "B") == 1.0


@pytest.mark.parametrize("kind,record,words", [
    ("math", {"question": "x?", "answer": "no digits"}, "no final answer"),
    ("math", {"answer": "#### 1"}, "missing field 'prompt' or 'question'"),
    ("choice", {"prompt": "p", "answer": "maybe"}, "one letter A-J"),
    ("constraints", {"prompt": "p", "constraints": [{"type": "rhyme"}]},
     "'type' must be an IFEval instruction id or one of"),
    ("constraints", {"prompt": "p", "instruction_id_list": [
        "length_constraints:number_words"], "kwargs": [
            {"relation": "about", "num_words": 3}]}, "supported relation"),
    ("constraints", {"prompt": "p", "instruction_id_list": [
        "punctuation:no_comma"], "kwargs": []}, "one 'kwargs' object"),
    ("constraints", {"prompt": "p", "constraints": [{"type": "min_words"}]},
     "needs 'value'"),
])
def test_a_bad_record_names_file_and_line(tmp_path, kind, record, words):
  path = tmp_path / f"{kind}.jsonl"
  good = {"math": {"question": "1+1?", "answer": "2"},
          "choice": {"prompt": "p", "answer": "A"},
          "constraints": {"prompt": "p",
                          "constraints": [{"type": "lowercase"}]}}[kind]
  path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
  with pytest.raises(DataError, match=f"{kind}.jsonl:2: .*{words}"):
    domains.get_domain(f"{kind}:{path}")


def test_unknown_kind_lists_the_file_kinds():
  with pytest.raises(DataError, match=r"math\|choice\|constraints:<path>"):
    domains.get_domain("poetry:/tmp/x.jsonl")


def test_ifeval_records_are_graded_by_if_verifiable(tmp_path):
  """IFEval's record format and instruction ids, graded strictly by the
  IFEval verifiers (if-verifiable is the reference): every instruction
  must hold, ours and theirs mixed in one record."""
  from if_verifiable.common import evaluate_instructions
  from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
  ids = ["punctuation:no_comma", "length_constraints:number_words"]
  kwargs = [{}, {"relation": "less than", "num_words": 6}]
  path = tmp_path / "ifeval.jsonl"
  path.write_text(json.dumps({"prompt": "Say hi.", "instruction_id_list":
                              ids, "kwargs": kwargs}) + "\n" + json.dumps({
      "prompt": "Say hi.", "constraints": [{"type": "max_chars",
                                             "value": 12},
                                            {"type": ids[0]}]}) + "\n")
  spec = domains.get_domain(f"constraints:{path}")
  ifeval, mixed = spec.records
  for text in ("hello there", "hello, there", "one two three four five six",
               "hi"):
    _, scores = evaluate_instructions(text, ids, kwargs, "Say hi.",
                                      INSTRUCTION_DICT)
    assert spec.verify(text, ifeval.answer) == scores.binary_strict
  assert spec.verify("hello there", mixed.answer) == 1.0
  assert spec.verify("hello, there", mixed.answer) == 0.0  # their comma
  assert spec.verify("hello there again", mixed.answer) == 0.0  # our count
