"""The fusion study's comparison: every model's evaluation turned into
``results.json`` (the statistics below) and ``report.md`` with figures.

Per model and domain, from an evaluation on ``N`` test prompts:

* accuracy ``p`` (greedy and sampled) with its standard error
  ``sqrt(p (1 - p) / N)``;
* pass@k from ``n`` samples at temperature 1 (``evaluation/pass_at_k.py``);
* headroom recovery ``(p_model - p_base) / (p_oracle - p_base)`` per
  training domain, ``None`` where the oracle has no headroom over the base
  (``p_oracle <= p_base``), and the mean of the defined ones (``None`` if
  none is);
* retention on a held-out domain: ``p_model - p_base`` (signed);
* the transfer matrix ``T[d][e] = p_expert_d(e) - p_base(e)``.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from mopd_jax.evaluation import headroom

MODES = ("greedy", "sampled")
# paradigm -> whether a model of the study belongs to it (what the
# recommendation compares: the best model of each)
FAMILIES = {"merge": lambda m: m.startswith("merge/"),
            "mix_rl": lambda m: m == "mix_rl",
            "mopd": lambda m: m in ("mopd", "open_mopd")}


def versus_mopd(model: str) -> bool:
  """Whether ``model`` is a consolidation the report sets against plain
  MOPD (Open-MOPD, the delta teacher, a token router, MOPD from a merge,
  the merge or MOPD of co-evolved experts)."""
  return model.startswith(("open_mopd", "mopd_", "copd_"))


def standard_error(p: float, n: int) -> float:
  """``sqrt(p (1 - p) / n)``: the standard error of an accuracy ``p``
  measured on ``n`` prompts."""
  return math.sqrt(max(p * (1 - p), 0.0) / n)


def recovery(model: Mapping[str, float], base: Mapping[str, float],
             oracle: Mapping[str, float], domains: Sequence[str]) -> dict:
  """Headroom recovery per domain (``None`` without headroom) and ``mean``
  (of the defined ones; ``None`` if none is)."""
  out = {d: ((model[d] - base[d]) / (oracle[d] - base[d])
             if oracle[d] > base[d] else None) for d in domains}
  defined = [v for v in out.values() if v is not None]
  out["mean"] = float(np.mean(defined)) if defined else None
  return out


def retention(model: Mapping[str, float], base: Mapping[str, float],
              held_out: Sequence[str]) -> dict:
  """``p_model - p_base`` on each held-out domain the model was evaluated
  on (the oracle routes no held-out domain)."""
  return {d: model[d] - base[d] for d in held_out if d in model}


def transfer(experts: Mapping[str, Mapping[str, float]],
             base: Mapping[str, float], domains: Sequence[str]) -> dict:
  """``T[d][e]``: expert ``d``'s accuracy change over the base on ``e``."""
  return {d: {e: experts[d][e] - base[e] for e in domains} for d in experts}


def pass_at_k_of(scalars: Mapping[str, float]) -> dict:
  """``{domain: {k: pass@k}}`` from ``eval/pass@<k>/<domain>`` scalars."""
  out: dict = {}
  for key, value in scalars.items():
    if key.startswith("eval/pass@"):
      k, domain = key[len("eval/pass@"):].split("/", 1)
      out.setdefault(domain, {})[int(k)] = value
  return {d: dict(sorted(v.items())) for d, v in sorted(out.items())}


def model_entry(scalars: Mapping[str, float], base: Mapping[str, dict],
                oracle: Mapping[str, dict], domains: Sequence[str],
                held_out: Sequence[str], num_prompts: int,
                cost: Mapping | None = None) -> dict:
  """One model's entry of ``results.json``: ``accuracy`` (greedy),
  ``sampled_accuracy``, ``stderr`` (of the greedy accuracy),
  ``pass_at_k``, ``headroom_recovery`` (greedy, and ``_sampled``),
  ``retention`` and ``cost``. ``base`` and ``oracle`` map a mode to
  ``{domain: accuracy}``."""
  acc = {m: headroom.accuracies(scalars, m) for m in MODES}
  return dict(
      accuracy=acc["greedy"], sampled_accuracy=acc["sampled"],
      stderr={d: standard_error(p, num_prompts)
              for d, p in acc["greedy"].items()},
      pass_at_k=pass_at_k_of(scalars),
      headroom_recovery=recovery(acc["greedy"], base["greedy"],
                                 oracle["greedy"], domains),
      headroom_recovery_sampled=recovery(acc["sampled"], base["sampled"],
                                         oracle["sampled"], domains),
      retention=retention(acc["greedy"], base["greedy"], held_out),
      cost=dict(cost or {}))


def mean_over(accuracy: Mapping[str, float], domains: Sequence[str]) -> float:
  return float(np.mean([accuracy[d] for d in domains]))


def recommendation(results: Mapping) -> dict:
  """Which paradigm when, from this study's numbers: the best of each
  paradigm on the training-domain mean (greedy), each domain's winner (and
  the paradigms tied with it within two standard errors), and
  each paradigm's compute; with where that agrees with the published
  guideline (Merge when experts exist and cheap fusion matters, Mix RL when
  there are no experts, MOPD when each domain's gain matters most)."""
  domains = results["domains"]
  methods = results["methods"]
  families = {f: [m for m in methods if member(m)]
              for f, member in FAMILIES.items()}
  best = {}
  for family, names in families.items():
    if names:
      name = max(names, key=lambda n: mean_over(methods[n]["accuracy"],
                                                domains))
      cost = methods[name]["cost"]
      best[family] = dict(model=name, mean=mean_over(
          methods[name]["accuracy"], domains),
                          flops=cost.get("with_experts", cost).get("flops"))
  def accuracy(family, d):
    return methods[best[family]["model"]]["accuracy"][d]

  def stderr(family, d):
    return methods[best[family]["model"]].get("stderr", {}).get(d, 0.0)

  winners = {d: max(best, key=lambda f: accuracy(f, d))
             for d in domains} if best else {}
  # Paradigms within two standard errors of the difference from the winner
  # (sqrt(se_w^2 + se_f^2)): at this many prompts, a tie.
  tied = {d: sorted((f for f in best if accuracy(w, d) - accuracy(f, d)
                      <= 2 * (stderr(w, d) ** 2 + stderr(f, d) ** 2) ** 0.5),
                     key=lambda f, d=d: -accuracy(f, d))
          for d, w in winners.items()}
  lines = []
  if best:
    top = max(best, key=lambda f: best[f]["mean"])
    lines.append(f"Highest training-domain mean (greedy): {top}"
                 f" ({best[top]['model']}, {100 * best[top]['mean']:.1f}%); "
                 + ", ".join(f"{f} {100 * b['mean']:.1f}%"
                             for f, b in best.items()) + ".")
  if len(best) > 1:  # a study of one paradigm (MOPD variants) ranks none
    spread = max(b["mean"] for b in best.values()) - min(
        b["mean"] for b in best.values())
    lines.append(f"The paradigms' means differ by {100 * spread:.1f} points;"
                 " per domain the best (with those within two standard"
                 " errors) is " + ", ".join(
                     f"{d}: {' = '.join(tied[d])}" for d in winners) + ".")
    if "merge" in best and "mopd" in best and best["mopd"].get("flops"):
      ratio = (best["merge"].get("flops") or 0) / best["mopd"]["flops"]
      lines.append(
          f"Merge costs {ratio:.2f}x MOPD's compute (both counting the"
          " experts): " + ("it is the cheap choice when experts exist, as"
                           " the guideline says" if best["merge"]["mean"]
                           >= best["mopd"]["mean"] - 0.05 else
                           "cheap, but more than 5 points behind MOPD here,"
                           " so the guideline's 'cheap fusion' costs accuracy"
                           " on these domains") + ".")
    if "mopd" in best:
      keeps = [d for d in domains if "mopd" in tied.get(d, ())]
      lines.append(f"MOPD is best or tied on {len(keeps)} of"
                   f" {len(domains)} domains"
                   + (f" ({', '.join(keeps)})" if keeps else "")
                   + ("; the guideline's choice when each domain's gain"
                      " matters most" if len(keeps) * 2 >= len(domains)
                      else "; here it does not keep each domain's gain best,"
                      " against the guideline") + ".")
  if "mopd_from_merge" in methods and "mopd" in methods:
    both = [methods[n] for n in ("mopd_from_merge", "mopd")]
    means = [mean_over(m["accuracy"], domains) for m in both]
    flops = [m["cost"].get("with_experts", m["cost"]).get("flops")
             for m in both]
    lines.append(
        f"MOPD from the best merge: {100 * means[0]:.1f}% mean against"
        f" plain MOPD's {100 * means[1]:.1f}% at the same MOPD steps"
        + (f", at {flops[0] / flops[1]:.2f}x its compute (both counting"
           " the experts)" if flops[0] and flops[1] else "") + ".")
  if "mix_rl" in best:
    lines.append("Mix RL needs no experts: "
                 f"{100 * best['mix_rl']['mean']:.1f}% mean, the choice"
                 " when no experts exist.")
  return dict(best=best, winners=winners, tied=tied, text=" ".join(lines))
