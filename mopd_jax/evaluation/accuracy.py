"""Per-domain accuracy: sample completions for test prompts, grade each with
its domain's exact verifier."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np

from mopd_jax import parallel
from mopd_jax.data.batching import encode_prompts
from mopd_jax.data.domains import get_domain
from mopd_jax.rollout import sampler


def generate(params, model_cfg, tokenizer, prompts: Sequence[str],
             sampling: sampler.SamplingConfig, key: jax.Array,
             batch_size: int, width: int) -> tuple[list[str], list[int]]:
  """Decoded completions of ``prompts`` and their lengths in tokens (stop
  token included when produced), sampled ``batch_size`` at a time.

  A last batch of fewer prompts is padded with empty rows to the next
  power of two (a multiple of the data-parallel devices), which the
  sampler never decodes, and every batch's prompts are only as wide as
  its longest needs (``encode_prompts(fit=True)``): a few prompts cost a
  few rows, and a few shapes are compiled.
  """
  mesh = jax.sharding.get_mesh()
  devices = parallel.data_parallel(mesh)
  texts, lengths = [], []
  for start in range(0, len(prompts), batch_size):
    chunk = list(prompts[start:start + batch_size])
    rows = min(batch_size, 1 << (len(chunk) - 1).bit_length())
    rows = -(-rows // devices) * devices
    tokens, mask = encode_prompts(chunk, tokenizer, width, rows=rows,
                                  fit=True)
    rollout = sampler.sample(params, model_cfg, tokens, mask,
                             jax.random.fold_in(key, start), sampling)
    rollout = parallel.to_host(rollout)
    texts += [tokenizer.decode(row) for row in rollout.completion[:len(chunk)]]
    lengths += rollout.mask[:len(chunk)].sum(axis=1).tolist()
  return texts, lengths


def grade(domain: str, completions: Sequence[str], examples: Sequence,
          lengths: Sequence[int]) -> dict:
  """``accuracy`` (fraction with reward 1), mean ``reward`` and ``length``,
  and ``correct``: each prompt's 1/0 (what a seeded study's intervals
  resample)."""
  verify = get_domain(domain).verify
  rewards = np.array([verify(c, e.answer) for c, e in zip(completions,
                                                           examples)])
  return dict(accuracy=float(np.mean(rewards >= 1.0)),
              reward=float(np.mean(rewards)), length=float(np.mean(lengths)),
              correct=(rewards >= 1.0).astype(np.int8))


def evaluate(params, model_cfg, tokenizer, examples: Mapping[str, Sequence],
             sampling: sampler.SamplingConfig, key: jax.Array,
             batch_size: int, width: int) -> dict[str, dict[str, float]]:
  """``{domain: grade(...)}`` over each domain's examples."""
  results = {}
  for i, (name, exs) in enumerate(sorted(examples.items())):
    texts, lengths = generate(params, model_cfg, tokenizer,
                              [e.prompt for e in exs], sampling,
                              jax.random.fold_in(key, i), batch_size, width)
    results[name] = grade(name, texts, exs, lengths)
  return results


def format_table(results: Mapping[str, Mapping[str, Mapping[str, float]]]
                 ) -> str:
  """A plain-text table: one row per domain, one column per (mode, metric).

  ``results`` maps a mode name (e.g. ``"t=1.0"``, ``"greedy"``) to the output
  of ``evaluate``.
  """
  modes = list(results)
  domains = sorted({d for r in results.values() for d in r})
  header = ["domain"] + [f"{m} acc" for m in modes] + [f"{modes[0]} len"]
  rows = [header]
  for d in domains:
    rows.append([d] + [f"{100 * results[m][d]['accuracy']:.1f}%"
                       for m in modes]
                + [f"{results[modes[0]][d]['length']:.1f}"])
  widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
  lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)
