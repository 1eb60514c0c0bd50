"""Benchmark: fused vocabulary ops against materialised logits, forward+backward.

    python experiments/bench_ops.py [--quick] [--n=8192 --d=512 --v=32768]
        [--block_v=...] [--impl=auto] [--keep_logits_mib=-1] [--repeats=3]

For each op (token log-probs with entropy; reverse + forward KL to a teacher)
it compiles ``grad`` of a scalar loss w.r.t. ``(h, w)`` both ways and prints,
measured in this one process: XLA's peak temporary memory of the compiled
function (``memory_analysis().temp_size_in_bytes``), the median wall time,
and the largest error of the fused outputs and gradients relative to the
naive ones (``max |x - ref| / max |ref|`` per array). The last line is one
JSON object; its top-level ``memory_ratio`` (naive / fused temp bytes),
``time_ratio`` (fused / naive time) and ``max_rel_err`` are the worst over
the ops. ``--quick`` runs N=2048, d=256, V=8192 (seconds on a laptop CPU).
``--keep_logits_mib``: as the config's ``ops.keep_logits_mib`` (-1, the
default, keeps logits for the backward pass on the CPU; 0 recomputes them,
the memory-linear path accelerators take).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from mopd_jax.ops import vocab
from mopd_jax.ops import vocab_naive as naive
from mopd_jax.timing import timed


def losses(args):
  """``{op: (fused_loss, naive_loss)}``, each ``(h, w, data) -> (loss, outs)``.

  ``data = (targets, teacher_h, teacher_w, c)`` is an argument, not a closed
  over constant, so XLA cannot fold the teacher's logits at compile time.
  """
  ops = vocab.VocabOps(impl=args.impl, block_v=args.block_v,
                       keep_logits_mib=args.keep_logits_mib)

  def logprobs_fused(h, w, data):
    targets, _, _, c = data
    logp, ent = vocab.token_logprobs(h, w, targets, with_entropy=True, ops=ops)
    return jnp.sum(c * (logp + ent)), (logp, ent)

  def logprobs_naive(h, w, data):
    targets, _, _, c = data
    logp, ent = naive.token_logprobs(h, w, targets)
    return jnp.sum(c * (logp + ent)), (logp, ent)

  def kl_fused(h, w, data):
    _, teacher_h, teacher_w, c = data
    kl = vocab.vocab_kl(h, w, teacher_h, teacher_w, ops=ops)
    return jnp.sum(c * kl.mix(0.5)), (kl.reverse, kl.forward)

  def kl_naive(h, w, data):
    _, teacher_h, teacher_w, c = data
    reverse, forward, _ = naive.kl(h, w, teacher_h, teacher_w)
    return jnp.sum(c * (0.5 * reverse + 0.5 * forward)), (reverse, forward)

  return {"logprobs": (logprobs_fused, logprobs_naive),
          "kl": (kl_fused, kl_naive)}


def measure(loss, h, w, data, repeats):
  """Temp bytes, median seconds and the ``(grads, outputs)`` of one loss."""
  fn = jax.jit(jax.grad(loss, (0, 1), has_aux=True))
  temp = fn.lower(h, w, data).compile().memory_analysis().temp_size_in_bytes
  seconds = timed(lambda: jax.block_until_ready(fn(h, w, data)), repeats)
  return temp, seconds, fn(h, w, data)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="N=2048, d=256, V=8192 instead of the sizes below")
  parser.add_argument("--n", type=int, default=8192)
  parser.add_argument("--d", type=int, default=512)
  parser.add_argument("--v", type=int, default=32768)
  parser.add_argument("--block_v", type=int, default=None)
  parser.add_argument("--impl", default="auto")
  parser.add_argument("--keep_logits_mib", type=int, default=-1)
  parser.add_argument("--ops", default="logprobs,kl")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  n, d, v = (2048, 256, 8192) if args.quick else (args.n, args.d, args.v)
  print(f"backend={jax.default_backend()} impl={vocab.resolve_impl(args.impl)}"
        f" N={n} d={d} V={v} float32")
  keys = jax.random.split(jax.random.key(0), 6)
  h = jax.random.normal(keys[0], (n, d))
  w = jax.random.normal(keys[1], (d, v)) * 2 / d ** 0.5
  data = (jax.random.randint(keys[2], (n,), 0, v),
          jax.random.normal(keys[3], (n, d)),
          jax.random.normal(keys[4], (d, v)) * 2 / d ** 0.5,
          jax.random.normal(keys[5], (n,)))
  report = {"n": n, "d": d, "v": v, "backend": jax.default_backend()}
  for op, (fused, reference) in losses(args).items():
    if op not in args.ops.split(","):
      continue
    f_temp, f_time, f_out = measure(fused, h, w, data, args.repeats)
    n_temp, n_time, n_out = measure(reference, h, w, data, args.repeats)
    err = max(naive.rel_err(a, b) for a, b in zip(jax.tree.leaves(f_out),
                                                  jax.tree.leaves(n_out)))
    report[op] = {"fused_temp_mib": f_temp / 2 ** 20,
                  "naive_temp_mib": n_temp / 2 ** 20,
                  "fused_s": f_time, "naive_s": n_time,
                  "memory_ratio": n_temp / f_temp,
                  "time_ratio": f_time / n_time, "max_rel_err": err}
    print(f"{op:9s} temp fused {f_temp / 2 ** 20:8.1f} MiB naive"
          f" {n_temp / 2 ** 20:8.1f} MiB ({n_temp / f_temp:5.1f}x)   time fused"
          f" {f_time:7.3f} s naive {n_time:7.3f} s ({f_time / n_time:4.2f}x)"
          f"   max rel err {err:.1e}")
  ops = [report[op] for op in ("logprobs", "kl") if op in report]
  report["memory_ratio"] = min(o["memory_ratio"] for o in ops)
  report["time_ratio"] = max(o["time_ratio"] for o in ops)
  report["max_rel_err"] = max(o["max_rel_err"] for o in ops)
  print(json.dumps(report))


if __name__ == "__main__":
  main()
