"""An expert stops by measurement: at the first evaluation where its
domain's greedy accuracy on the validation split has gained ``stop.gain``
over the model it started from, ``acc_t - acc_0 >= gain``, and, with
``stop.confirm_prompts``, the same gain holds on a second, disjoint draw
of validation prompts, ``acc'_t - acc'_0 >= gain``.

Stopping at the first of many looks that reaches a threshold on one set
of prompts selects that set's lucky draws (a winner's curse: the default
study's experts stopped at +20 points on validation and landed +14 to
+32 on test). The second draw is looked at only where the first has
passed: the first time, an unselected measurement of that step; after a
refusal it is looked at again at each later pass, so it lowers the curse
(two independent draws must pass at one step) rather than removing it.

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


CONFIRM = "validation_confirm"  # the second draw's scalars' prefix


def validation_accuracy(scalars, domain: str,
                        prefix: str = splits.VALIDATION) -> float:
  """``domain``'s greedy accuracy from a validation evaluation's scalars
  (``prefix``: the first draw's, or ``CONFIRM``)."""
  return headroom.accuracies(scalars, "greedy", prefix)[domain]


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
  ``stop.num_prompts`` prompts), the confirming draw (the next
  ``stop.confirm_prompts`` validation prompts) where the first has gained
  ``stop.gain``, the test evaluation ``test_eval`` (``eval.json``) only
  where the run ends. ``params``: the starting model, evaluated once on
  both draws here as the reference."""
  domain, stop = config.domain, config.stop
  validation = list(splits.domain_splits(config, (domain,),
                                         splits.VALIDATION)[domain])
  draws = {splits.VALIDATION: validation[:stop.num_prompts]}
  if stop.confirm_prompts:
    draws[CONFIRM] = validation[stop.num_prompts:stop.num_prompts
                                + stop.confirm_prompts]
  evals = {prefix: evaluator.make_eval_fn(
      config, model_cfg, tokenizer, {domain: examples}, mesh,
      greedy_only=True, prefix=prefix, num_prompts=len(examples))
           for prefix, examples in draws.items()}
  start = {prefix: validation_accuracy(fn({"params": params}, 0), domain,
                                       prefix)
           for prefix, fn in evals.items()}

  def record_of(step, scalars):
    """The stop record when every draw looked at has gained the target."""
    record = gain_record(step, validation_accuracy(scalars, domain),
                         start[splits.VALIDATION], stop)
    if record and CONFIRM in evals:
      second = validation_accuracy(scalars, domain, CONFIRM)
      if second - start[CONFIRM] < stop.gain - 1e-9:
        return None
      record.update(reason=record["reason"] + f", confirmed on"
                    f" {len(draws[CONFIRM])} other validation prompts"
                    f" ({second - start[CONFIRM]:+.3f})",
                    validation_confirm_greedy=second,
                    validation_confirm_greedy_start=start[CONFIRM])
    return record

  def eval_fn(state, step):
    scalars = dict(evals[splits.VALIDATION](state, step))
    if CONFIRM in evals and gain_record(
        step, validation_accuracy(scalars, domain),
        start[splits.VALIDATION], stop):
      scalars.update(evals[CONFIRM](state, step))
    if step >= config.train.steps or record_of(step, scalars):
      final = test_eval(state, step)
      runs.write_eval(workdir, step)(final)
      scalars.update(final)
    return scalars

  def on_eval(state, step, scalars):
    record = record_of(step, scalars)
    if record:
      print(f"expert {domain} stopped at step {step}: {record['reason']}")
    elif step >= config.train.steps:
      confirm = ""
      if any(k.startswith(CONFIRM + "/") for k in scalars):
        second = validation_accuracy(scalars, domain, CONFIRM)
        confirm = (f"; the second draw {second:.3f}, from"
                   f" {start[CONFIRM]:.3f}")
      print(f"expert {domain}: stop.gain {stop.gain} not reached by step"
            f" {step} (validation greedy"
            f" {validation_accuracy(scalars, domain):.3f}, from"
            f" {start[splits.VALIDATION]:.3f}{confirm}); kept as the expert")
    return state, record

  return eval_fn, on_eval
