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


from absl import flags
from ml_collections import config_flags

from mopd_jax import cli, convert, parallel, stages
from mopd_jax.data.domains import DOMAINS
from mopd_jax.errors import UserError
from mopd_jax.evaluation.run_eval import evaluate_run, run_settings




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
      " remat, attention_chunk, attention_impl, scan_layers) any run is"
      " computed with;"
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
  # an imported checkpoint has no data or sampling settings: Mix RL's
  fill = settings or stages.defaults("mix_rl")
  mesh = fill.mesh if hf_checkpoint else run_settings(
      f.run, fill, execution=settings is not None).mesh
  parallel.use_cpu_devices(mesh.get("cpu_devices", 1))
  with convert.as_run(f.run) as run_dir:
    evaluate_run(run_dir, f.num_prompts, f.domains, fill, f.output,
                 f.samples, f.coverage_prompts,
                 execution=settings is not None)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
