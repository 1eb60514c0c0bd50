"""An expert stops by measurement: at the first evaluation where its
domain's greedy accuracy on the validation split has gained ``stop.gain``
over the model it started from, ``acc_t - acc_0 >= gain``.

Domains learn at rates that differ several-fold (on the built-in base,
``add`` gains 20 points in under 100 steps, ``sort`` in about 300), so one
step count either wastes time on the fast ones or leaves the slow ones
short; a target gain on validation gives every expert the same kind of
headroom over the base on any machine. ``train.steps`` is then the limit:
an expert that never reaches the gain ends there (no error: it is still
the best expert the budget gives, and the study goes on).
"""

from __future__ import annotations

from mopd_jax import runs
from mopd_jax.data import splits
from mopd_jax.evaluation import evaluator, headroom


def validation_accuracy(scalars, domain: str) -> float:
  """``domain``'s greedy accuracy from a validation evaluation's scalars."""
  return headroom.accuracies(scalars, "greedy", splits.VALIDATION)[domain]


def gain_record(step: int, accuracy: float, start: float, stop
                ) -> dict | None:
  """The stop record when ``accuracy - start >= stop.gain``, else None
  (accuracies are fractions k/n: 1e-9 absorbs the subtraction's rounding,
  0.6 - 0.4 = 0.19999999999999996)."""
  if accuracy - start < stop.gain - 1e-9:
    return None
  return dict(step=step, reason=f"greedy validation accuracy gained"
              f" {accuracy - start:+.3f} >= {stop.gain} over the start",
              gain=stop.gain, validation_greedy=accuracy,
              validation_greedy_start=start)


def gain_stop(config, model_cfg, tokenizer, mesh, params, test_eval,
              workdir: str):
  """``(eval_fn, on_eval)`` for ``training.run_loop``: a greedy validation
  evaluation of ``config.domain`` every ``train.eval_every`` steps (on
  ``stop.num_prompts`` prompts), the test evaluation ``test_eval``
  (``eval.json``) only where the run ends. ``params``: the starting
  model, evaluated once here as the reference."""
  domain = config.domain
  val_eval = evaluator.make_eval_fn(
      config, model_cfg, tokenizer,
      splits.domain_splits(config, (domain,), splits.VALIDATION), mesh,
      greedy_only=True, prefix=splits.VALIDATION,
      num_prompts=config.stop.num_prompts)

  def accuracy(scalars) -> float:
    return validation_accuracy(scalars, domain)

  start = accuracy(val_eval({"params": params}, 0))

  def eval_fn(state, step):
    scalars = dict(val_eval(state, step))
    if step >= config.train.steps or gain_record(
        step, accuracy(scalars), start, config.stop):
      final = test_eval(state, step)
      runs.write_eval(workdir, step)(final)
      scalars.update(final)
    return scalars

  def on_eval(state, step, scalars):
    record = gain_record(step, accuracy(scalars), start, config.stop)
    if record:
      print(f"expert {domain} stopped at step {step}: {record['reason']}")
    elif step >= config.train.steps:
      print(f"expert {domain}: stop.gain {config.stop.gain} not reached by"
            f" step {step} (validation greedy {accuracy(scalars):.3f}, from"
            f" {start:.3f}); kept as the expert")
    return state, record

  return eval_fn, on_eval
