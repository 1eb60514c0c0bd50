"""A finished run's evaluation on more test prompts, and its coverage.

Greedy and sampled (the run's ``eval.temperature``) accuracy of a run's
final parameters on every domain's test split, written with the keys of
the run's own ``eval.json`` (the headroom report reads either), each
prompt's 1/0 (``outcomes``) and, with ``samples``, pass@k from that many
samples of each prompt (``coverage``). What ``python -m mopd_jax.evaluate``
and a study's evaluations run.
"""

from __future__ import annotations

import copy
import os

import jax

from mopd_jax import checkpointing, parallel, runs
from mopd_jax.atomic import write_json_atomic
from mopd_jax.data import splits
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import evaluator, pass_at_k
from mopd_jax.models import tokenizer as tokenizer_lib
from mopd_jax.rollout.sampler import SamplingConfig


def eval_file_name(num_prompts: int) -> str:
  return f"eval_{num_prompts}.json"


def output_path(run_dir: str, num_prompts: int, output: str = "") -> str:
  return output or os.path.join(os.path.expanduser(run_dir),
                                eval_file_name(num_prompts))


# The sections of a run's config that its evaluation reads.
SECTIONS = ("seed", "data", "sampling", "eval", "mesh")


def run_settings(run_dir: str, settings, execution: bool = True):
  """The config that evaluates the run in ``run_dir``: its own, with
  ``SECTIONS`` it lacks (an imported checkpoint has none) taken from
  ``settings`` (a run method's config) and, with ``execution``, its
  execution fields too (a study evaluates every model in one
  precision)."""
  config = runs.load_run_config(run_dir)
  for key in SECTIONS:
    if key not in config:
      config[key] = copy.deepcopy(settings[key])
  if execution:
    runs.with_execution_fields(config.model, settings.model)
  return config


def evaluate_run(run_dir: str, num_prompts: int, domains, settings,
                 output: str = "", samples: int = 0,
                 coverage_prompts: int = 0, execution: bool = True
                 ) -> dict[str, float]:
  """Evaluate the final parameters of ``run_dir`` on ``num_prompts`` test
  prompts of each of ``domains`` (and pass@k from ``samples`` samples of
  each of the first ``coverage_prompts`` of them, all when 0, when
  ``samples > 0``), with ``run_settings(run_dir, settings, execution)``;
  write the scalars, each prompt's greedy/sampled 1/0 (``outcomes``) and
  correct sample counts (``coverage``), and return the scalars."""
  if num_prompts <= 0:
    raise ConfigError(f"--num_prompts: {num_prompts} must be > 0")
  if samples < 0:
    raise ConfigError(f"--samples: {samples} must be >= 0")
  if not 0 <= coverage_prompts <= num_prompts:
    raise ConfigError(f"--coverage_prompts: {coverage_prompts} must be in"
                      f" [0, --num_prompts={num_prompts}]")
  config = run_settings(run_dir, settings, execution)
  path = output_path(run_dir, num_prompts, output)
  _check_writable(path, "--output" if output else "--run")
  tokenizer = tokenizer_lib.of_run(run_dir)
  runs.check_same_tokens(run_dir, config, tokenizer, "--run")
  config.data.eval_jsonl = ""
  config.data.test_examples = max(num_prompts, config.data.test_examples)
  config.eval.num_prompts = num_prompts
  tokenizer, model_cfg, mesh = runs.setup(config, tokenizer)
  with parallel.use_rules(config.mesh.get("rules", parallel.DEFAULT_RULES)):
    params = runs.load_params(run_dir, model_cfg, mesh)
    test = {d: list(exs)[:num_prompts]
            for d, exs in splits.eval_sets(config, domains).items()}
    outcomes, coverage = {}, {}
    eval_fn = evaluator.make_eval_fn(config, model_cfg, tokenizer, test, mesh,
                                     outcomes=outcomes)
    step = checkpointing.newest_step(run_dir)  # the one loaded
    scalars = eval_fn({"params": params}, step)
    if samples:
      subset = {d: exs[:coverage_prompts or num_prompts]
                for d, exs in test.items()}
      coverage = _coverage(config, params, model_cfg, tokenizer, subset,
                           mesh, samples)
      scalars.update({f"eval/pass@{k}/{d}": v for d, counts in
                      coverage["counts"].items()
                      for k, v in pass_at_k.by_k(samples, counts).items()})
  write_json_atomic(path, {"step": step, **scalars,
                           "outcomes": outcomes, "coverage": coverage})
  print(f"wrote {path}")
  return scalars


def _check_writable(path: str, flag: str) -> None:
  """Before any work: ``path`` can be written (its folder exists and is
  writable, and it is not a folder itself)."""
  folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
  if not os.path.isdir(folder):
    raise ConfigError(f"{flag}: cannot write {path}: {folder} is not a"
                      " directory")
  if os.path.isdir(path):
    raise ConfigError(f"{flag}: cannot write {path}: it is a directory")
  if not os.access(folder, os.W_OK):
    raise ConfigError(f"{flag}: cannot write {path}: {folder} is not"
                      " writable")


def _coverage(config, params, model_cfg, tokenizer, test, mesh, samples):
  """``{samples, counts: {domain: [c_i]}}`` (correct samples per prompt),
  printing each domain's pass@k."""
  sampling = SamplingConfig.of(config.sampling, tokenizer,
                                        temperature=config.eval.temperature)
  with parallel.activate(mesh):
    counts = pass_at_k.correct_counts(
        params, model_cfg, tokenizer, test, sampling,
        jax.random.fold_in(jax.random.key(config.seed), 3),
        config.eval.batch_size, config.data.max_prompt_len, samples)
  print(f"\npass@k from {samples} samples per prompt:")
  for domain, c in counts.items():
    print(f"  {domain:9s}" + "  ".join(
        f"@{k} {100 * v:.1f}%" for k, v in pass_at_k.by_k(samples, c).items()))
  return dict(samples=samples, counts={d: c.tolist()
                                       for d, c in counts.items()})
