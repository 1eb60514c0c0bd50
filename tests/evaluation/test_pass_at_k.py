import itertools

import jax
import numpy as np
import pytest

from mopd_jax.data.domains import Example
from mopd_jax.evaluation import accuracy
from mopd_jax.evaluation.pass_at_k import (by_k, correct_counts, ks_up_to,
                                          pass_at_k, per_prompt)


def _enumerated(n, c, k):
  """The fraction of all k-subsets of n samples (c correct) with a hit."""
  samples = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_pass_at_k_matches_enumerating_every_subset(n):
  rng = np.random.default_rng(0)
  correct = rng.integers(0, n + 1, size=7)
  for k in range(1, n + 1):
    expected = [_enumerated(n, int(c), k) for c in correct]
    np.testing.assert_allclose(per_prompt(n, correct, k), expected,
                               atol=1e-12)
    assert pass_at_k(n, correct, k) == pytest.approx(np.mean(expected),
                                                     abs=1e-12)


def test_pass_at_1_is_accuracy_and_edges():
  assert pass_at_k(16, np.array([0, 4, 16]), 1) == pytest.approx(
      np.mean([0, 4 / 16, 1]))
  assert pass_at_k(16, np.array([0, 0]), 16) == 0.0
  assert pass_at_k(16, np.array([1, 0]), 16) == 0.5
  with pytest.raises(ValueError):
    pass_at_k(4, np.array([1]), 5)


def test_ks_up_to():
  assert list(ks_up_to(16)) == [1, 2, 4, 8, 16]
  assert list(ks_up_to(12)) == [1, 2, 4, 8, 12]
  assert list(ks_up_to(1)) == [1]


def test_coverage_grades_each_prompts_samples_together(monkeypatch):
  """Prompt i of 3 gets i correct samples out of 4 (in a fixed order)."""
  exs = [Example(f"add {i}+0=", str(i), "add") for i in range(3)]

  def fake_generate(params, cfg, tok, prompts, sampling, key, batch, width):
    assert prompts == [e.prompt for e in exs for _ in range(4)]
    texts = [str(i) if j < i else "x" for i in range(3) for j in range(4)]
    return texts, [1] * len(texts)

  monkeypatch.setattr(accuracy, "generate", fake_generate)
  counts = correct_counts(None, None, None, {"add": exs}, None,
                          jax.random.key(0), 8, 8, 4)
  assert list(counts) == ["add"] and counts["add"].tolist() == [0, 1, 2]
  out = {"add": by_k(4, counts["add"])}
  assert list(out["add"]) == [1, 2, 4]
  assert out["add"][1] == pytest.approx((0 + 1 / 4 + 2 / 4) / 3)
  assert out["add"][2] == pytest.approx((0 + 1 / 2 + 5 / 6) / 3)
  assert out["add"][4] == pytest.approx(2 / 3)
