"""Evaluate a finished run: ``python -m mopd_jax.evaluate --run=DIR``.

Greedy and sampled (the run's ``eval.temperature``) accuracy of the run's
final parameters on every domain's test split, written to
``<run>/eval_<N>.json`` (``N``: prompts per domain) with the keys of the
run's own ``eval.json``, so that the headroom report can read either. More
prompts than the training-time evaluation narrow the noise of small
differences: the standard error of an accuracy ``p`` over ``N`` prompts is
``sqrt(p (1 - p) / N)``, 3.1 points at ``p = 0.5`` and ``N = 256``, 1.6 at
``N = 960``. The run's directory is only added to, never rewritten.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from mopd_jax import parallel, training
from mopd_jax.data.domains import DOMAINS
from mopd_jax.errors import ConfigError, UserError, fail
from mopd_jax.models.tokenizer import CharTokenizer
from mopd_jax.stages import common

_RUN = flags.DEFINE_string("run", None, "Run directory to evaluate.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 960,
                                    "Test prompts per domain (`add` has 993).")
_DOMAINS = flags.DEFINE_list("domains", list(DOMAINS),
                             "Domains to evaluate (comma-separated).")
_OUTPUT = flags.DEFINE_string("output", "", "Where to write the scalars"
                              " (default: <run>/eval_<num_prompts>.json).")
flags.mark_flags_as_required(["run"])


def output_path(run_dir: str, num_prompts: int, output: str = "") -> str:
  return output or os.path.join(os.path.expanduser(run_dir),
                                f"eval_{num_prompts}.json")


def evaluate_run(run_dir: str, num_prompts: int, domains, output: str = ""
                 ) -> dict[str, float]:
  """Evaluate the final parameters of ``run_dir`` on ``num_prompts`` test
  prompts of each of ``domains``; write and return the scalars."""
  if num_prompts <= 0:
    raise ConfigError(f"--num_prompts: {num_prompts} must be > 0")
  config = common.load_run_config(run_dir)
  common.check_same_tokens(run_dir, config, CharTokenizer(), "--run")
  config.data.eval_jsonl = ""
  config.data.test_examples = max(num_prompts, config.data.test_examples)
  config.eval.num_prompts = num_prompts
  tokenizer, model_cfg, mesh = common.setup(config)
  with parallel.use_rules(config.mesh.get("rules", parallel.DEFAULT_RULES)):
    params = common.load_params(run_dir, model_cfg, mesh)
    eval_fn = common.make_eval_fn(config, model_cfg, tokenizer,
                                  common.eval_sets(config, domains), mesh)
    step = config.train.steps
    scalars = eval_fn({"params": params}, step)
  path = output_path(run_dir, num_prompts, output)
  training.write_json_atomic(path, {"step": step, **scalars})
  print(f"wrote {path}")
  return scalars


def main(argv) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  try:
    evaluate_run(_RUN.value, _NUM_PROMPTS.value, _DOMAINS.value,
                 _OUTPUT.value)
  except UserError as e:
    fail(str(e))


if __name__ == "__main__":
  app.run(main)
