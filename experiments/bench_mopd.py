"""Benchmark: one MOPD step against TRL's ``DistillationTrainer``.

    python experiments/bench_mopd.py [--steps=8] [--out=runs/bench_mopd]
        [--cpu_devices=2]

The same model on both sides (the built-in architecture, near its random
initialisation; TRL's through ``models.hf``): the student samples 32
completions of up to 32 tokens at temperature 1 (stopping at EOS), one
teacher of the same shape scores them, one AdamW update on the reverse
KL over the whole vocabulary (ours ``opd.loss=kl``; TRL ``beta=1``,
on-policy). Ours is the real training command (``configs/mopd.py``), with
one teacher (domain ``chain``) and with four (the built-in case); TRL has
one teacher. Each figure is the median over the steps after the first
two (compilation), read from the runs' own step timings; printed per step
and per completion token, with the ratio TRL / ours per completion token
as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("add", "chain", "instruct", "sort")
BATCH, NEW_TOKENS, GROUP = 32, 32, 4


def train(workdir: str, config: str, *overrides: str) -> None:
  cmd = [sys.executable, "-m", "mopd_jax.train", f"--config={config}",
         f"--workdir={workdir}", *overrides]
  result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if result.returncode:
    sys.exit(f"bench_mopd: {' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def near_random_base(out: str, data_dir: str, model: list[str]) -> str:
  """A run directory of the built-in architecture one step (at a learning
  rate of 1e-9) from its random initialisation."""
  base = os.path.join(out, "base")
  if not os.path.exists(os.path.join(base, "summary.json")):
    train(base, f"{ROOT}/configs/pretrain.py", "--config.train.steps=1",
          "--config.optim.learning_rate=1e-9", "--config.optim.warmup_steps=0",
          "--config.select.target=0", "--config.eval.num_prompts=8",
          f"--config.data.data_dir={data_dir}", *model)
  return base


def ours(out: str, base: str, data_dir: str, domains, steps: int,
         cpu_devices: int) -> dict:
  """Median seconds per MOPD step and completion tokens per step."""
  workdir = os.path.join(out, f"mopd_{len(domains)}_{domains[0]}")
  teachers = ",".join(f"{d}={base}" for d in domains)
  train(workdir, f"{ROOT}/configs/mopd.py", f"--config.init={base}",
        f"--config.teachers={teachers}",
        f"--config.data.domains={tuple(domains)!r}".replace(" ", ""),
        f"--config.rl.prompts_per_step={BATCH // GROUP}",
        f"--config.rl.group_size={GROUP}", "--config.rl.minibatches=1",
        "--config.rl.epochs=1", "--config.opd.loss=kl",
        f"--config.sampling.max_new_tokens={NEW_TOKENS}",
        f"--config.train.steps={steps}", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.eval.num_prompts=8",
        f"--config.checkpoint.every={steps}",
        f"--config.mesh.cpu_devices={cpu_devices}",
        f"--config.data.data_dir={data_dir}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "steps_per_sec" in r][2:]
  return {"seconds": float(np.median([1 / r["steps_per_sec"] for r in rows])),
          "tokens": float(np.median([r["response_length"] * BATCH
                                     for r in rows]))}


def trl_step(base: str, steps: int) -> dict:
  """Median seconds per ``DistillationTrainer`` step on the same weights,
  and completion tokens per step."""
  import datasets
  import torch
  import transformers
  from trl import DistillationConfig, DistillationTrainer

  from mopd_jax import runs
  from mopd_jax.data import domains
  from mopd_jax.models import hf
  from mopd_jax.models.tokenizer import CharTokenizer

  files = os.path.join(os.path.dirname(base), "char_tokenizer")
  CharTokenizer().save_hf(files)
  fast = transformers.AutoTokenizer.from_pretrained(files,
                                                    padding_side="left")

  cfg, params = runs.final_model(base)
  config = transformers.AutoConfig.for_model(
      **hf.hf_config(cfg), pad_token_id=0, bos_token_id=1, eos_token_id=2)

  def model():
    m = transformers.AutoModelForCausalLM.from_config(config,
                                                      dtype=torch.float32)
    m.load_state_dict({k: torch.from_numpy(np.array(v))
                       for k, v in hf.to_hf(params, cfg).items()},
                      strict=False)
    return m

  prompts = [e.prompt for e in domains.generate("chain", "train",
                                                BATCH * steps, seed=0)]
  args = DistillationConfig(
      output_dir=os.path.join(os.path.dirname(base), "trl"),
      per_device_train_batch_size=BATCH, max_completion_length=NEW_TOKENS,
      temperature=1.0, beta=1.0, bf16=False, gradient_checkpointing=False,
      max_steps=steps, logging_steps=1, save_strategy="no", report_to=[],
      learning_rate=1e-6, use_cpu=True, disable_tqdm=True)
  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *_, **__):
      self.start = time.perf_counter()

    def on_step_end(self, *_, **__):
      times.append(time.perf_counter() - self.start)

  trainer = DistillationTrainer(
      model=model(), teacher_model=model(), args=args,
      train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
      processing_class=fast, callbacks=[Timer()])
  trainer.remove_callback(transformers.PrinterCallback)  # a dict per step
  trainer.train()
  lengths = [h["completions/mean_length"] for h in trainer.state.log_history
             if "completions/mean_length" in h]
  return {"seconds": float(np.median(times[2:])),
          "tokens": float(np.median(lengths[2:])) * BATCH}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--out", default="runs/bench_mopd")
  parser.add_argument("--data_dir", default="")
  parser.add_argument("--teachers", default="1,4",
                      help="our runs: with this many teachers each (1: the"
                      " chain domain; 2-4: the first n built-in domains)")
  parser.add_argument("--base", default="", help="an existing run to use"
                      " as the student and every teacher (default: a"
                      " near-random base of the built-in model)")
  parser.add_argument("--model", default="",
                      help="the base's model overrides, e.g."
                      " 'embed_dim=32,num_layers=1'")
  parser.add_argument("--cpu_devices", type=int, default=1,
                      help="our runs' mesh.cpu_devices")
  parser.add_argument("--json", default="", help="also write figures here")
  args = parser.parse_args()
  out = os.path.abspath(args.out)
  data_dir = args.data_dir or os.path.join(out, "data")
  model = [f"--config.model.{kv}" for kv in filter(None,
                                                   args.model.split(","))]
  base = args.base or near_random_base(out, data_dir, model)
  counts = [int(c) for c in args.teachers.split(",")]
  figures = {"trl_1_teacher": trl_step(base, args.steps)}
  for n in counts:
    figures[f"ours_{n}_teachers"] = ours(
        out, base, data_dir, ("chain",) if n == 1 else DOMAINS[:n],
        args.steps, args.cpu_devices)
  for name, f in figures.items():
    f["ms_per_token"] = 1e3 * f["seconds"] / f["tokens"]
    print(f"{name:16s} {f['seconds']:7.3f} s/step  {f['tokens']:6.0f}"
          f" completion tokens  {f['ms_per_token']:.3f} ms/token")
  trl = figures["trl_1_teacher"]["ms_per_token"]
  ratios = {n: trl / figures[f"ours_{n}_teachers"]["ms_per_token"]
            for n in counts}
  figures["ratio"] = {str(n): r for n, r in ratios.items()}
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=2)
  print("ratio per completion token (TRL / ours): " + ", ".join(
      f"{n} teacher{'s' * (n > 1)} {r:.2f}x" for n, r in ratios.items()))


if __name__ == "__main__":
  main()
