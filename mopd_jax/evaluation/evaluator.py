"""The evaluation a run does as it trains (and at its end): sampled and
greedy accuracy per domain, as scalars for the metric log."""

from __future__ import annotations

import jax

from mopd_jax import parallel
from mopd_jax.evaluation import accuracy
from mopd_jax.rollout.sampler import SamplingConfig


def make_eval_fn(config, model_cfg, tokenizer, test, mesh, on_final=None,
                 greedy_only=False, prefix="eval", num_prompts=None,
                 outcomes=None):
  """Sampled (``eval.temperature``) and greedy accuracy on every domain
  (greedy only when ``greedy_only``), on the first ``num_prompts``
  (default ``eval.num_prompts``) examples of each domain in ``test``.

  Prints a table, returns ``<prefix>/<mode>/<domain>/<metric>`` scalars,
  hands the final step's scalars to ``on_final``, and fills ``outcomes``
  (when given) with each prompt's 1/0, ``{<mode>/<domain>: [...]}``.
  """
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  num_prompts = num_prompts or config.eval.num_prompts
  subsets = {d: list(exs)[:num_prompts] for d, exs in test.items()}
  modes = {} if greedy_only else {"sampled": config.eval.temperature}
  if config.eval.greedy or greedy_only:
    modes["greedy"] = 0.0

  def eval_fn(state, step):
    results = {}
    with parallel.activate(mesh):
      for mode, temperature in modes.items():
        sampling = SamplingConfig.of(config.sampling, tokenizer,
                                              temperature=temperature)
        results[mode] = accuracy.evaluate(
            state["params"], model_cfg, tokenizer, subsets, sampling,
            jax.random.fold_in(key, step), config.eval.batch_size,
            config.data.max_prompt_len)
    title = {"eval": "evaluation"}.get(prefix, prefix)
    print(f"\n{title} at step {step}:\n" + accuracy.format_table(results))
    scalars = {f"{prefix}/{mode}/{d}/{metric}": value
               for mode, r in results.items() for d, m in r.items()
               for metric, value in m.items() if metric != "correct"}
    if outcomes is not None:
      outcomes.update({f"{mode}/{d}": m["correct"].tolist()
                       for mode, r in results.items() for d, m in r.items()})
    if on_final and step == config.train.steps:
      on_final(scalars)
    return scalars

  return eval_fn
