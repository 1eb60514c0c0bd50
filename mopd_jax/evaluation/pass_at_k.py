"""Solution coverage: pass@k from ``n`` samples per prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from mopd_jax.evaluation import accuracy


def per_prompt(num_samples: int, num_correct: np.ndarray, k: int
               ) -> np.ndarray:
  """Each prompt's unbiased estimator ``pass@k = 1 - C(n - c, k) / C(n, k)``:
  the chance that at least one of ``k`` samples drawn without replacement
  from the ``n`` graded ones is correct (``c`` of them are). Computed as
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, which avoids huge
  binomials."""
  if not 1 <= k <= num_samples:
    raise ValueError(f"k={k} must be in [1, n={num_samples}]")
  values = []
  for correct in np.asarray(num_correct).reshape(-1):
    if num_samples - correct < k:
      values.append(1.0)
    else:
      i = np.arange(num_samples - correct + 1, num_samples + 1)
      values.append(1.0 - float(np.prod(1.0 - k / i)))
  return np.array(values)


def pass_at_k(num_samples: int, num_correct: np.ndarray, k: int) -> float:
  """The mean over prompts of ``per_prompt``."""
  return float(np.mean(per_prompt(num_samples, num_correct, k)))


def ks_up_to(num_samples: int) -> Sequence[int]:
  """1, 2, 4, ... up to ``num_samples`` (and ``num_samples`` itself)."""
  ks = [1 << i for i in range(num_samples.bit_length())
        if 1 << i <= num_samples]
  return ks if ks[-1] == num_samples else ks + [num_samples]


def correct_counts(params, model_cfg, tokenizer,
                   examples: Mapping[str, Sequence], sampling, key: jax.Array,
                   batch_size: int, width: int, num_samples: int
                   ) -> dict[str, np.ndarray]:
  """``{domain: [c_i]}``: how many of ``num_samples`` completions of each
  example its domain's verifier grades correct."""
  out = {}
  for i, (name, exs) in enumerate(sorted(examples.items())):
    prompts = [e.prompt for e in exs for _ in range(num_samples)]
    texts, lengths = accuracy.generate(params, model_cfg, tokenizer, prompts,
                                       sampling, jax.random.fold_in(key, i),
                                       batch_size, width)
    correct = accuracy.grade(name, texts, [e for e in exs
                                           for _ in range(num_samples)],
                             lengths)["correct"]
    out[name] = correct.reshape(len(exs), num_samples).sum(axis=1)
  return out


def by_k(num_samples: int, counts: np.ndarray) -> dict[int, float]:
  """``{k: pass@k}`` for ``k`` in ``ks_up_to(num_samples)``."""
  return {k: pass_at_k(num_samples, counts, k)
          for k in ks_up_to(num_samples)}

