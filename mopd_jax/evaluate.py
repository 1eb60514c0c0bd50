"""Evaluate a finished run: ``python -m mopd_jax.evaluate --run=DIR``.

Greedy and sampled (the run's ``eval.temperature``) accuracy of the run's
final parameters on every domain's test split, written to
``<run>/eval_<N>.json`` (``N``: prompts per domain) with the keys of the
run's own ``eval.json``, so that the headroom report can read either. More
prompts than the training-time evaluation narrow the noise of small
differences: the standard error of an accuracy ``p`` over ``N`` prompts is
``sqrt(p (1 - p) / N)``, 3.1 points at ``p = 0.5`` and ``N = 256``, 1.6 at
``N = 960``. With ``--samples=n`` it also measures solution coverage:
pass@k (``k`` = 1, 2, 4, ... n) from ``n`` samples of each prompt at the
evaluation temperature, keys ``eval/pass@<k>/<domain>``. The run's
directory is only added to, never rewritten. ``--run`` may be a Hugging
Face checkpoint directory, read as ``convert import`` reads it (nothing
is written into it: ``--output`` is then required). An imported checkpoint
(``mopd_jax.convert``) has no data or sampling settings of its own: the
defaults', or those of ``--settings=configs/<method>.py[:variant]``
(e.g. ``configs/mix_rl.py:hf``: 512-token prompts, 1,024-token
completions, bfloat16).
"""

from __future__ import annotations

import copy
import os

import jax
from absl import flags
from ml_collections import config_flags

from mopd_jax import (checkpointing, cli, convert, parallel, runs, stages,
                      training)
from mopd_jax.data import splits
from mopd_jax.data.domains import DOMAINS
from mopd_jax.errors import ConfigError, UserError
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


def run_settings(run_dir: str, settings=None):
  """The config that evaluates the run in ``run_dir``: its own, with
  ``SECTIONS`` it lacks (an imported checkpoint has none) taken from
  ``settings`` (default: Mix RL's defaults) and, when ``settings`` is
  given, its execution fields (a study evaluates every model in one
  precision)."""
  config = runs.load_run_config(run_dir)
  fill = settings or stages.defaults("mix_rl")
  for key in SECTIONS:
    if key not in config:
      config[key] = copy.deepcopy(fill[key])
  if settings is not None:
    runs.with_execution_fields(config.model, settings.model)
  return config


def evaluate_run(run_dir: str, num_prompts: int, domains, output: str = "",
                 samples: int = 0, settings=None, coverage_prompts: int = 0
                 ) -> dict[str, float]:
  """Evaluate the final parameters of ``run_dir`` on ``num_prompts`` test
  prompts of each of ``domains`` (and pass@k from ``samples`` samples of
  each of the first ``coverage_prompts`` of them, all when 0, when
  ``samples > 0``), with ``run_settings(run_dir, settings)``; write the
  scalars, each prompt's greedy/sampled 1/0 (``outcomes``) and correct
  sample counts (``coverage``), and return the scalars."""
  if num_prompts <= 0:
    raise ConfigError(f"--num_prompts: {num_prompts} must be > 0")
  if samples < 0:
    raise ConfigError(f"--samples: {samples} must be >= 0")
  if not 0 <= coverage_prompts <= num_prompts:
    raise ConfigError(f"--coverage_prompts: {coverage_prompts} must be in"
                      f" [0, --num_prompts={num_prompts}]")
  config = run_settings(run_dir, settings)
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
  training.write_json_atomic(path, {"step": step, **scalars,
                                    "outcomes": outcomes,
                                    "coverage": coverage})
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


def define_flags() -> None:
  """The command's flags (defined when it runs, not when imported: the
  study and the experiments import this module as a library)."""
  flags.DEFINE_string("run", None, "Run directory (or Hugging Face"
                      " checkpoint directory) to evaluate.")
  flags.DEFINE_integer("num_prompts", 960,
                       "Test prompts per domain (`add` has 993).")
  flags.DEFINE_list("domains", list(DOMAINS),
                    "Domains to evaluate (comma-separated).")
  flags.DEFINE_integer("samples", 0, "n > 0: pass@k from n samples per"
                       " prompt (0: no coverage measurement).")
  flags.DEFINE_integer("coverage_prompts", 0, "pass@k on the first this"
                       " many test prompts of each domain (0: all"
                       " --num_prompts).")
  flags.DEFINE_string("output", "", "Where to write the scalars (default:"
                      " <run>/eval_<num_prompts>.json).")
  config_flags.DEFINE_config_file(
      "settings", None, "A config (e.g. configs/mix_rl.py:hf) whose seed,"
      " data, sampling, eval and mesh sections evaluate a run that has none"
      " (an imported checkpoint), and whose execution fields (model.dtype,"
      " remat, attention_chunk, attention_impl) any run is computed with;"
      " overrides as"
      " --settings.data.max_prompt_len=1024.", lock_config=True)
  flags.mark_flags_as_required(["run"])


def main() -> None:
  f = flags.FLAGS
  settings = cli.config_value(f["settings"], "settings")
  hf_checkpoint = convert.is_hf_checkpoint(f.run)
  if hf_checkpoint and not f.output:
    raise UserError(f"--output: needed for {f.run}, a Hugging Face"
                    " checkpoint directory (nothing is written into it)")
  if not f.domains:
    raise UserError("--domains: empty; name at least one domain")
  if settings is not None:
    if "init" in settings:  # the run evaluated is the one it starts from
      settings.init = f.run
    settings = stages.validate(settings)
  # Before anything touches a device, as in train.
  mesh = (settings or stages.defaults("mix_rl")).mesh if (
      hf_checkpoint) else run_settings(f.run, settings).mesh
  parallel.use_cpu_devices(mesh.get("cpu_devices", 1))
  with convert.as_run(f.run) as run_dir:
    evaluate_run(run_dir, f.num_prompts, f.domains, f.output,
                 f.samples, settings, f.coverage_prompts)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
