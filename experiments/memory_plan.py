"""Per-device memory plan of a MOPD run, and a check against XLA.

    python experiments/memory_plan.py --model=qwen7b --teachers=3 \
        --mesh 4,16,1 1,64,1 --hbm_gib=16
    python experiments/memory_plan.py --check   # tiny model, 8 fake CPUs

For each mesh ``data,fsdp,tensor`` (and ``--rules``) it prints the bytes one
device holds, every array placed by the logical-axis rules exactly as the
code places it (``parallel.mesh_spec``: a mesh axis that does not divide a
dimension leaves it replicated):

* ``params``: the student's parameters (``model.param_dtype``);
* ``adam``: AdamW's two moments, float32, sharded like the parameters;
* ``grads``: one gradient per parameter (``param_dtype``);
* ``teachers``: ``--teachers`` frozen copies of the same architecture,
  held in ``dtype`` (a bfloat16 run's teachers in bfloat16);
* ``kv``: the rollout KV cache, ``2 L B S K d_h`` elements (``dtype``),
  ``B = --rollout_batch`` sequences of ``S = --length`` slots, split over
  ``batch`` and ``kv_heads``;
* ``act``: activations the backward pass keeps for a train minibatch of
  ``--train_batch`` sequences of ``T = --length`` tokens. Per layer and
  token: ``4 D`` (residual in/mid and both norm outputs) ``+ 2 H d_h``
  (queries, attention output) ``+ 2 K d_h`` (keys, values) ``+ 3 F``
  (gate, up, SwiGLU) elements of ``dtype``, plus ``2 H T`` float32 scores
  and probabilities (dense attention); times ``L``. With ``--chunk c``
  (blocked attention, ``model.attention_chunk``) the scores are replaced
  by what its backward pass keeps, ``H (d_h + 2)`` float32 per token (the
  output, the running max and denominator), linear in ``T``, plus one
  block's ``3 H T c`` float32 (probabilities and their gradients) at a
  time. With ``--remat`` (per-layer rematerialisation, ``model.remat``):
  ``L D`` per token plus one layer's full set. The vocabulary ops never
  hold ``[tokens, V]`` logits and are left out.

``--mfu`` and ``--peak_tflops`` turn a table row into the train step's
predicted throughput: ``tokens/s per device = mfu * peak / flops per
token`` and ``ModelConfig.train_flops_per_token``'s ``6 N + 12 L H d_h
T`` model FLOPs a token (MFU does not count remat's second forward
pass).

``--check`` compiles the tiny model's train step and the sampler's cache
allocation on a (2,2,2) mesh of 8 fake CPU devices and prints these
estimates next to XLA's ``compiled.memory_analysis()`` (arguments = params +
adam + batch, temps = grads + activations, output = KV cache) with their
ratios, and the train step's temps at 1,024 and 2,048 tokens with dense
and with blocked attention (quadratic against linear in ``T``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import numpy as np
import optax

from mopd_jax import parallel, runs, training
from mopd_jax.models import decoder
from mopd_jax.models.config import PRESETS
from mopd_jax.objectives.sft import make_train_step

def _bytes(axis_sizes, names, shape, itemsize) -> float:
  """Bytes of one device's shard of an array of ``shape``."""
  ways = 1
  for entry in parallel.mesh_spec(axis_sizes, names, shape):
    for axis in (entry,) if isinstance(entry, str) else entry or ():
      ways *= axis_sizes[axis]
  return math.prod(shape) * itemsize / ways


def plan(cfg, axis_sizes: dict, teachers: int, rollout_batch: int,
         train_batch: int, length: int, remat: bool, chunk: int = 0
         ) -> dict:
  """``{component: bytes per device}`` (see the module docstring)."""
  shapes = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0)))
  names = decoder.logical_axes(cfg)
  leaves = list(zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec)), jax.tree.leaves(shapes)))
  p_size = np.dtype(cfg.param_dtype).itemsize
  a_size = np.dtype(cfg.dtype).itemsize

  def params(itemsize):
    return sum(_bytes(axis_sizes, n, s.shape, itemsize) for n, s in leaves)

  L, D, H, K, Dh, F = (cfg.num_layers, cfg.embed_dim, cfg.num_heads,
                       cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim)
  B, T = train_batch, length
  bt, bth = ("batch", "length"), ("batch", "length", "heads", "head_dim")
  heads = ("batch", "heads", None, None)
  if chunk and length > chunk:  # else the keys fit one block: dense
    scores = _bytes(axis_sizes, heads, (B, H, T, Dh + 2), 4)
    block = 3 * _bytes(axis_sizes, heads, (B, H, T, chunk), 4)
  else:
    scores, block = 2 * _bytes(axis_sizes, heads, (B, H, T, T), 4), 0
  one_layer = (
      4 * _bytes(axis_sizes, bt + ("embed",), (B, T, D), a_size)
      + 2 * _bytes(axis_sizes, bth, (B, T, H, Dh), a_size)
      + _bytes(axis_sizes, decoder.KEY_AXES, (B, K, Dh, T), a_size)
      + _bytes(axis_sizes, decoder.VALUE_AXES, (B, K, T, Dh), a_size)
      + 3 * _bytes(axis_sizes, bt + ("mlp",), (B, T, F), a_size) + scores)
  residual = _bytes(axis_sizes, bt + ("embed",), (B, T, D), a_size)
  kv = (_bytes(axis_sizes, ("layers",) + decoder.KEY_AXES,
               (L, rollout_batch, K, Dh, length), a_size)
        + _bytes(axis_sizes, ("layers",) + decoder.VALUE_AXES,
                 (L, rollout_batch, K, length, Dh), a_size))
  act = L * residual + one_layer if remat else L * one_layer
  return dict(params=params(p_size), adam=params(8), grads=params(p_size),
              teachers=teachers * params(a_size), kv=kv,
              act=act + block)


def _parse_mesh(text: str) -> dict:
  sizes = [int(s) for s in text.split(",")]
  if len(sizes) != 3 or min(sizes) < 1:
    raise SystemExit(f"--mesh: {text!r} is not data,fsdp,tensor")
  return dict(zip(("data", "fsdp", "tensor"), sizes))


def _gib(x: float) -> str:
  return f"{x / 2**30:.2f}"


def print_table(args) -> None:
  cfg = PRESETS[args.model]
  columns = ("params", "adam", "grads", "teachers", "kv", "act")
  print(f"{args.model}: {cfg.num_params() / 1e9:.2f}B parameters,"
        f" {args.teachers} teachers, rollout {args.rollout_batch} x"
        f" {args.length}, train minibatch {args.train_batch} x"
        f" {args.length}, rules {args.rules}"
        f"{', remat' if args.remat else ''}"
        f"{f', attention blocks of {args.chunk}' if args.chunk else ''};"
        " GiB per device")
  speed = args.mfu > 0
  flops = cfg.train_flops_per_token(args.length)
  if speed:
    print(f"train tokens/s at {args.mfu:.0%} MFU of {args.peak_tflops:g}"
          f" TFLOP/s a device, {flops / 1e9:.1f} GFLOP a token")
  print("| mesh (data,fsdp,tensor) | " + " | ".join(columns)
        + " | total | of HBM |" + (" train tokens/s |" if speed else ""))
  print("|---" * (len(columns) + 3 + speed) + "|")
  with parallel.use_rules(args.rules):
    for text in args.mesh:
      sizes = _parse_mesh(text)
      row = plan(cfg, sizes, args.teachers, args.rollout_batch,
                 args.train_batch, args.length, args.remat, args.chunk)
      total = sum(row.values())
      tokens = (math.prod(sizes.values()) * args.mfu * args.peak_tflops
                * 1e12 / flops)
      rate = f" {tokens:,.0f} |" if speed else ""
      print(f"| {text} | " + " | ".join(_gib(row[c]) for c in columns)
            + f" | {_gib(total)} | {total / (args.hbm_gib * 2**30):.0%} |"
            + rate)


def _compiled_train(cfg, mesh, batch: int, length: int):
  """XLA's memory analysis of the train step, compiled only, and the
  bytes of its token batch."""
  optimizer = optax.adamw(1e-3)
  step = make_train_step(cfg, optimizer)
  tokens = np.ones((batch, length), np.int32)
  with parallel.activate(mesh):
    params = jax.device_put(
        jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                     runs.param_shapes(cfg)),
        runs.param_shardings(cfg, mesh))
    state = training.init_state(params, optimizer)
    data = parallel.shard_batch(mesh, dict(tokens=tokens, segment_ids=tokens,
                                           loss_mask=tokens))
    return (jax.jit(step).lower(state, data).compile().memory_analysis(),
            tokens.nbytes)


# --check: the lengths and key block of the dense-against-blocked rows.
LONG, BLOCK = (1024, 2048), 256


def check() -> list[tuple[str, float, float]]:
  """``(quantity, estimate, XLA)`` for the tiny model on a (2,2,2) mesh of
  8 fake CPU devices (the process must have been started with them)."""
  cfg = PRESETS["tiny"]
  mesh = parallel.make_mesh(2, 2, 2)
  batch, length = 16, 64
  est = plan(cfg, dict(mesh.shape), 0, batch, batch, length, remat=False)
  train, token_bytes = _compiled_train(cfg, mesh, batch, length)
  with parallel.activate(mesh):
    cache = jax.jit(lambda: decoder.init_cache(cfg, batch, length)).lower(
        ).compile().memory_analysis()
  data_parallel = parallel.data_parallel(mesh)
  rows = [
      ("arguments: params + adam + batch",
       est["params"] + est["adam"] + 3 * token_bytes / data_parallel,
       train.argument_size_in_bytes),
      ("temps: grads + activations", est["grads"] + est["act"],
       train.temp_size_in_bytes),
      ("KV cache (with its slot segment ids)",
       est["kv"] + token_bytes / data_parallel, cache.output_size_in_bytes),
  ]
  for chunk in (0, BLOCK):
    blocked = dataclasses.replace(cfg, attention_chunk=chunk)
    for length in LONG:
      est = plan(blocked, dict(mesh.shape), 0, data_parallel, data_parallel,
                 length, remat=False, chunk=chunk)
      measured = _compiled_train(blocked, mesh, data_parallel, length)[0]
      attention = f"blocked ({chunk} keys)" if chunk else "dense"
      rows.append((f"temps at T={length}, {attention} attention",
                   est["grads"] + est["act"], measured.temp_size_in_bytes))
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", choices=sorted(PRESETS), default="qwen7b")
  parser.add_argument("--teachers", type=int, default=3)
  parser.add_argument("--mesh", nargs="+", default=["4,16,1", "1,64,1"],
                      help="data,fsdp,tensor (several: one row each)")
  parser.add_argument("--rules", default="fsdp_tp")
  parser.add_argument("--rollout_batch", type=int, default=256)
  parser.add_argument("--train_batch", type=int, default=64)
  parser.add_argument("--length", type=int, default=2048)
  parser.add_argument("--hbm_gib", type=float, default=16.0)
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--chunk", type=int, default=0,
                      help="blocked attention over keys (0: dense)")
  parser.add_argument("--mfu", type=float, default=0.0,
                      help="predict train tokens/s at this MFU (0: off)")
  parser.add_argument("--peak_tflops", type=float, default=989.0,
                      help="a device's peak (H100 bfloat16 dense: 989)")
  parser.add_argument("--check", action="store_true",
                      help="tiny model against XLA on 8 fake CPU devices")
  args = parser.parse_args(argv)
  if args.check:
    print("| quantity | estimate KiB | XLA KiB | XLA / estimate |")
    print("|---|---|---|---|")
    for name, estimate, measured in check():
      print(f"| {name} | {estimate / 1024:.1f} | {measured / 1024:.1f} |"
            f" {measured / estimate:.2f} |")
  else:
    print_table(args)


if __name__ == "__main__":
  if "--check" in sys.argv[1:]:  # read when jax starts its backend
    os.environ.setdefault("XLA_FLAGS",
                          "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
