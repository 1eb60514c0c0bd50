"""What a run cost, from its metrics and config: tokens sampled, scored
by teachers and trained, training wall time, and model FLOPs
(``ModelConfig.forward_flops_per_token`` per sampled or teacher-scored
token, ``train_flops_per_token`` per trained token; the same accounting
as the benchmarks' MFU)."""

from __future__ import annotations

import os

from mopd_jax.distill.teachers import TOKEN_ROUTERS
from mopd_jax.metrics import read_metrics
from mopd_jax.models.config import ModelConfig


def teacher_models(config_json: dict) -> int:
  """The models a MOPD teacher's score runs per token: the expert (1), the
  proxy teacher's three, or the delta teacher's base and every expert;
  a label-free token router runs every teacher on every token (and
  ``expert_align`` the student once more, for its distribution)."""
  opd = config_json.get("opd", {})
  router = opd.get("router")
  n = len(config_json.get("data", {}).get("domains", ()))
  if router == "delta":
    return 1 + n
  per_teacher = 3 if opd.get("proxy_teacher") else 1
  if router in TOKEN_ROUTERS:
    return n * per_teacher + (router == "expert_align")
  return per_teacher


def off_policy_passes(config_json: dict, first: int, end: int) -> float:
  """Forward passes per sampled token, summed over steps ``first..end-1``
  (0-based), beyond sampling, scoring and training: the trainer's
  recomputation of ``pi_old`` wherever another policy sampled (teacher
  prefixes, the TRB warm-up, one-step-async rollouts) or ``rl.tis_cap``
  is on, and the teacher's own decode pass during the TRB warm-up."""
  opd, rl = config_json.get("opd", {}), config_json.get("rl", {})
  trb = max(0, min(end, int(opd.get("trb_steps", 0))) - first) if opd.get(
      "trb_delta", 0) > 0 else 0
  recompute = (opd.get("prefix") == "teacher" or rl.get("tis_cap", 0) > 0
               or rl.get("max_policy_lag", 0) > 0)
  return (end - first if recompute else trb) + trb


def run_cost(run_dir: str, config_json: dict, experts_cost=None) -> dict:
  """Sampled tokens (``rl.prompts_per_step x rl.group_size x`` the mean
  response length, per step), teacher-scored tokens (MOPD: the sampled
  ones, each through ``teacher_models`` forward passes), trained tokens
  (``x rl.epochs``; pretraining: the packed rows), training wall time (steps / steps_per_sec) and ``flops``, each token
  attending over ``data.max_prompt_len`` plus its row's mean response
  (pretraining: the packed row); ``with_experts`` adds ``experts_cost``.
  CoPD (``method`` copd) counts every expert of a round and the other
  experts' passes over each one's tokens."""
  model = config_json.get("model", {})
  cfg = ModelConfig(**model) if model else None
  records = read_metrics(run_dir) if os.path.exists(
      os.path.join(run_dir, "metrics.jsonl")) else []
  mopd = config_json.get("method") == "mopd"
  # CoPD: every expert samples and trains each step (a round), and each
  # one's tokens go through the J - 1 others for the reference
  experts = (len(config_json["data"]["domains"])
             if config_json.get("method") == "copd" else 1)
  sampled = trained = wall = flops = 0.0
  last = 0
  for r in records:
    if "steps_per_sec" not in r:
      continue
    steps = r["step"] - last
    last = r["step"]
    wall += steps / max(r["steps_per_sec"], 1e-9)
    if "response_length" in r:  # on-policy: sample, (score,) train
      tokens = (steps * experts * config_json["rl"]["prompts_per_step"]
                * config_json["rl"]["group_size"] * r["response_length"])
      length = config_json["data"]["max_prompt_len"] + r["response_length"]
      passes = (experts + (teacher_models(config_json) if mopd else 0)
                + off_policy_passes(config_json, last - steps, last)
                / max(steps, 1))
      epochs = config_json["rl"]["epochs"]
    elif "batch_size" in config_json.get("train", {}):  # pretraining rows
      length = (config_json["data"]["max_prompt_len"]
                + config_json["sampling"]["max_new_tokens"])
      trained += steps * config_json["train"]["batch_size"] * length
      if cfg:
        flops += (steps * config_json["train"]["batch_size"] * length
                  * cfg.train_flops_per_token(length))
      continue
    else:
      continue
    sampled += tokens
    trained += tokens * epochs
    if cfg:
      flops += tokens * (passes * cfg.forward_flops_per_token(length)
                         + epochs * cfg.train_flops_per_token(length))
  scored = sampled if mopd else 0.0
  cost = dict(tokens_sampled=sampled, tokens_teacher_scored=scored,
              tokens_trained=trained, wall_seconds=wall, flops=flops)
  if experts_cost:
    cost["with_experts"] = {k: cost[k] + experts_cost[k] for k in cost
                            if k in experts_cost}
  return cost
