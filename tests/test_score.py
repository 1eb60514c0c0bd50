"""The scoring CLI: per-token log-probs against each line scored alone,
the MOPD signal and the exact reverse KL against float64 numpy, and bad
input lines named by file and line with nothing written."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import python_m
from mopd_jax import score
from mopd_jax.errors import DataError
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.tokenizer import CharTokenizer

CFG = ModelConfig(embed_dim=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, mlp_dim=64)
TOK = CharTokenizer()


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def _alone(params, ids):
  """float64 log-softmax of one unpadded line, scored by itself."""
  logits, _ = decoder.apply(params, CFG, jnp.asarray([ids], jnp.int32),
                            jnp.ones((1, len(ids)), jnp.int32))
  z = np.asarray(logits[0, :-1], np.float64)
  return z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1,
                                                               keepdims=True)
                    ) - z.max(-1, keepdims=True)


def test_scores_match_each_line_alone_and_the_kl_numpy(tmp_path):
  path = _write(tmp_path / "in.jsonl", [
      json.dumps({"text": "12+30=42"}),
      json.dumps({"prompt": "sort: c a b", "completion": "a b c"}),
      "",
      json.dumps({"text": "x"})])
  lines = score.parse(path, TOK)
  assert [first for _, first in lines] == [1, 12, 1]
  assert lines[1][0][-1] == TOK.eos_id
  student = decoder.init_params(CFG, jax.random.key(0))
  teacher = decoder.init_params(CFG, jax.random.key(1))
  out = score.score_lines(lines, TOK, (CFG, student), (CFG, teacher),
                          batch_size=2)
  assert len(out) == 3
  for (ids, first), record in zip(lines, out):
    assert record["tokens"] == ids[first:]
    s, t = _alone(student, ids), _alone(teacher, ids)
    rows = np.arange(first - 1, len(ids) - 1)
    want = s[rows, ids[first:]]
    np.testing.assert_allclose(record["logprobs"], want, atol=1e-5)
    np.testing.assert_allclose(record["teacher_logprobs"],
                               t[rows, ids[first:]], atol=1e-5)
    np.testing.assert_allclose(record["signal"],
                               t[rows, ids[first:]] - want, atol=2e-5)
    kl = (np.exp(s[rows]) * (s[rows] - t[rows])).sum(-1)
    np.testing.assert_allclose(record["reverse_kl"], kl, atol=1e-5)
  assert out[1]["pieces"][-1] == "<eos>" and out[0]["pieces"][0] == "1"


@pytest.mark.parametrize("line,words", [
    ("{bad", "bad JSON"),
    ('{"prompt": "1+1="}', "'prompt' and 'completion'"),
    ('{"text": 3}', "must be a string"),
    ('{"text": "ABC"}', "not in the character tokenizer"),
    ('{"text": ""}', "nothing to score"),
])
def test_a_bad_line_names_file_and_line(tmp_path, line, words):
  path = _write(tmp_path / "in.jsonl", ['{"text": "1+1=2"}', line])
  with pytest.raises(DataError, match=f"in.jsonl:2: .*{words}"):
    score.parse(path, TOK)


def test_a_line_past_the_models_positions_is_named(tmp_path):
  path = _write(tmp_path / "in.jsonl", [json.dumps({"text": "1+1=2"}),
                                        json.dumps({"text": "12+30=42"})])
  assert len(score.parse(path, TOK, max_length=9)) == 2  # BOS + 8: fits
  with pytest.raises(DataError, match="in.jsonl:2: 9 tokens, more than the"
                     " model's max_position_embeddings 8$"):
    score.parse(path, TOK, max_length=8)


def _score_cli(*args):
  return python_m("mopd_jax.score", *args)


def test_cli_writes_every_line_or_nothing(tmp_path, smoke_run):
  run = str(smoke_run[0])
  good = _write(tmp_path / "in.jsonl", [json.dumps({"text": "7+5=12"}),
                                        json.dumps({"prompt": "9+1=",
                                                    "completion": "10"})])
  out = tmp_path / "out.jsonl"
  result = _score_cli(f"--model={run}", f"--teacher={run}",
                      f"--input={good}", f"--output={out}")
  assert result.returncode == 0, result.stderr[-2000:]
  records = [json.loads(x) for x in out.read_text().splitlines()]
  assert [len(r["tokens"]) for r in records] == [6, 3]
  assert all(abs(x) < 1e-5 for r in records for x in r["signal"])
  bad = _write(tmp_path / "bad.jsonl", [json.dumps({"text": "1"}), "[1]"])
  out2 = tmp_path / "out2.jsonl"
  result = _score_cli(f"--model={run}", f"--input={bad}", f"--output={out2}")
  assert result.returncode == 2
  assert result.stderr.strip() == (f"error: {bad}:2: expected a JSON object,"
                                   " got list")
  assert not out2.exists()
  result = _score_cli(f"--model={tmp_path}", f"--input={good}",
                      f"--output={out2}")
  assert result.returncode == 2 and "not a mopd_jax run directory" in (
      result.stderr) and not out2.exists()
