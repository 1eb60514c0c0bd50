"""Tests of the JSONL prompt loader."""

from __future__ import annotations

import json

import pytest

from mopd_jax.data import domains, example
from mopd_jax.data.jsonl import load_jsonl
from mopd_jax.errors import DataError

GOOD = {"prompt": "add 1+2=", "answer": "3", "domain": "add"}


def _write(tmp_path, lines: list[str]) -> str:
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return str(path)


def test_good_file_loads(tmp_path):
  examples = [domains.generate(d, "train", 3, 0) for d in domains.DOMAINS]
  examples = [ex for group in examples for ex in group]
  lines = [json.dumps(vars(ex)) for ex in examples]
  lines.insert(2, "")  # Blank lines are skipped.
  lines.insert(5, "   ")
  lines.append(json.dumps({**GOOD, "id": 7}))  # Extra keys are ignored.
  loaded = load_jsonl(_write(tmp_path, lines))
  assert loaded == examples + [example.Example("add 1+2=", "3", "add")]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "bad JSON"),
    ('["a list"]', "expected a JSON object"),
    (json.dumps({"prompt": "add 1+2=", "domain": "add"}),
     "missing field 'answer'"),
    (json.dumps({**GOOD, "answer": 3}), "field 'answer' must be a string"),
    (json.dumps({**GOOD, "prompt": ""}), "field 'prompt' is empty"),
    (json.dumps({**GOOD, "domain": "mul"}), "unknown domain 'mul'"),
    (json.dumps({**GOOD, "prompt": "Add 1+2="}),
     "field 'prompt' has characters ['A']"),
    (json.dumps({**GOOD, "answer": "3\u00e9"}),
     "field 'answer' has characters"),
    (json.dumps({**GOOD, "domain": "chain", "answer": "3"}),
     "does not pass the 'chain' verifier"),
    ('{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}",
     "nested too deeply"),
    ('{"prompt": ' + "1" * 10_000 + "}", "bad JSON"),
    ('{"prompt": "\\ud800 add"}', "lone surrogate"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
  path = _write(tmp_path, [json.dumps(GOOD), "", bad_line, json.dumps(GOOD)])
  with pytest.raises(DataError) as info:
    load_jsonl(path)
  text = str(info.value)
  assert text.startswith(f"{path}:3: "), text
  assert message in text
  assert "\n" not in text


def test_invalid_utf8_names_the_line(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
  with pytest.raises(DataError, match=f"{path}:2: not UTF-8"):
    load_jsonl(str(path))


def test_alphabet_check_can_be_skipped(tmp_path):
  path = _write(tmp_path, [json.dumps({**GOOD, "prompt": "Add 1+2="})])
  assert load_jsonl(path, alphabet=None)[0].prompt == "Add 1+2="


def test_missing_file_and_empty_file(tmp_path):
  missing = str(tmp_path / "nope.jsonl")
  with pytest.raises(DataError, match=f"{missing}: cannot read"):
    load_jsonl(missing)
  with pytest.raises(DataError, match="no examples"):
    load_jsonl(_write(tmp_path, ["", "  "]))


def test_prompt_longer_than_max_prompt_len_names_file_and_line(tmp_path):
  """Found at load (before any training), not at the first evaluation."""
  long = {**GOOD, "prompt": "add 1+2=" + " " * 16}  # 1 + 24 tokens
  path = _write(tmp_path, [json.dumps(GOOD), json.dumps(long)])
  with pytest.raises(DataError) as info:
    load_jsonl(path, max_prompt_len=24)
  assert str(info.value) == (f"{path}:2: field 'prompt': 25 tokens (with BOS)"
                             " exceed data.max_prompt_len=24")
  assert len(load_jsonl(path, max_prompt_len=25)) == 2
