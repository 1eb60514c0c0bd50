"""Benchmark: train-step throughput and MFU, sampler decode throughput.

    python experiments/bench_step.py [--preset=tiny] [--rows=32] [--length=72]
    # on an accelerator: Qwen3-0.6B's shape in bfloat16, remat, blocked
    # attention, against the device's datasheet peak
    python experiments/bench_step.py --preset=qwen3_0p6b --rows=16 \
        --length=2048 --remat --chunk=512 --peak_tflops=989 \
        [--attention=cudnn|splash]

Prints, all measured in this one process:
* the train step's tokens/s and model-FLOPs utilisation (MFU) against the
  peak of a large matmul in the model's dtype timed here (the machine's
  practical peak), or ``--peak_tflops`` (a datasheet's); and the rate of
  the step's own MLP matmul (``[rows x length, d] x [d, mlp]``) timed
  alone, the most its small matmuls reach on this machine;
* the train step's time with autodiff's backward pass of the projections
  over its time with ``decoder.matmul``'s written-out one, the two
  interleaved;
* the sampler's decode tokens/s (KV cache, ``lax.while_loop``) against a
  baseline that re-runs the full forward pass over the whole padded sequence
  for every new token (no cache), and the ratio of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import stages
from mopd_jax.models import decoder
from mopd_jax.models.config import ATTENTION_IMPLS, PRESETS, ModelConfig
from mopd_jax.objectives.sft import sft_loss
from mopd_jax.rollout import sampler
from mopd_jax.training import make_optimizer, init_state
from mopd_jax.timing import interleaved, timed


def matmul_rate(m: int, k: int, n: int, dtype: str = "float32") -> float:
  """FLOP/s of one ``[m, k] x [k, n]`` matmul in ``dtype``, timed alone."""
  a = jax.random.normal(jax.random.key(0), (m, k), dtype)
  b = jax.random.normal(jax.random.key(1), (k, n), dtype)
  mm = jax.jit(jnp.dot)
  return 2 * m * k * n / timed(lambda: mm(a, b).block_until_ready(), 5)


def bench_train(cfg: ModelConfig, rows: int, length: int, peak: float,
                repeats: int):
  """Train-step tokens/s, FLOP/s and MFU, and the step's time with
  autodiff's backward pass of the projections (``decoder.dense`` in place
  of ``decoder.matmul``, the same forward) over its time as it is, the
  calls interleaved."""
  # The base model's optimiser section itself, so that it cannot drift.
  optimizer = make_optimizer(stages.defaults("pretrain").optim, 1000)
  state = init_state(decoder.init_params(cfg, jax.random.key(0)), optimizer)
  rng = np.random.default_rng(0)
  batch = dict(tokens=rng.integers(3, cfg.vocab_size, (rows, length),
                                   dtype=np.int32),
               segment_ids=np.ones((rows, length), np.int32),
               loss_mask=np.ones((rows, length), np.int32))

  def make_step():
    # A new function each time: JAX caches a trace by the function traced.
    def step(state, batch):
      def loss_fn(p):
        s, c = sft_loss(p, cfg, batch)
        return s / c
      grads = jax.grad(loss_fn)(state["params"])
      updates, opt = optimizer.update(grads, state["opt_state"],
                                      state["params"])
      params = jax.tree.map(jnp.add, state["params"], updates)
      return dict(params=params, opt_state=opt, step=state["step"] + 1)
    return jax.jit(step)

  # Each traced now, with its projection (the jitted step keeps it).
  ours = make_step()
  ours(state, batch)
  with mock.patch.object(decoder, "matmul", decoder.dense):
    baseline = make_step()
    baseline(state, batch)
  seconds, base_seconds = interleaved(
      [lambda f=f: jax.block_until_ready(f(state, batch))
       for f in (ours, baseline)], repeats)
  tokens = rows * length
  flops = cfg.train_flops_per_token(length) * tokens / seconds
  return tokens / seconds, flops, flops / peak, base_seconds / seconds


def bench_decode(cfg: ModelConfig, batch: int, prompt_len: int, new: int):
  params = decoder.init_params(cfg, jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(1), (batch, prompt_len), 3,
                              cfg.vocab_size)
  mask = jnp.ones_like(prompt)
  # stop_ids=(): never stop early, so both paths generate exactly ``new`` tokens.
  sampling = sampler.SamplingConfig(max_new_tokens=new, stop_ids=())
  cached = timed(lambda: jax.block_until_ready(sampler.sample(
      params, cfg, prompt, mask, jax.random.key(2), sampling)), 3)

  @jax.jit
  def no_cache(params, prompt, key):
    tokens = jnp.pad(prompt, ((0, 0), (0, new)))
    segments = jnp.pad(jnp.ones_like(prompt), ((0, 0), (0, new)))

    def body(t, carry):
      tokens, segments, key = carry
      key, sub = jax.random.split(key)
      logits, _ = decoder.apply(params, cfg, tokens, segments)
      nxt = jax.random.categorical(sub, logits[:, prompt_len + t - 1])
      tokens = tokens.at[:, prompt_len + t].set(nxt.astype(jnp.int32))
      segments = segments.at[:, prompt_len + t].set(1)
      return tokens, segments, key

    return jax.lax.fori_loop(0, new, body, (tokens, segments, key))[0]

  baseline = timed(lambda: jax.block_until_ready(
      no_cache(params, prompt, jax.random.key(2))), 3)
  return batch * new / cached, batch * new / baseline


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--length", type=int, default=72)
  parser.add_argument("--decode_batch", type=int, default=128)
  parser.add_argument("--prompt_len", type=int, default=24)
  parser.add_argument("--new_tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=20,
                      help="train steps timed, each form")
  parser.add_argument("--peak_size", type=int, default=2048,
                      help="side of the matmul that measures the peak")
  parser.add_argument("--peak_tflops", type=float, default=0.0,
                      help="a device's peak instead of the measured one")
  parser.add_argument("--dtype", default="", choices=("", "float32",
                                                      "bfloat16"),
                      help="compute dtype (default: the preset's)")
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--chunk", type=int, default=0,
                      help="blocked attention over this many keys")
  parser.add_argument("--attention", default="xla",
                      choices=ATTENTION_IMPLS,
                      help="who computes attention without a cache")
  args = parser.parse_args(argv)
  cfg = dataclasses.replace(PRESETS[args.preset], remat=args.remat,
                            attention_chunk=args.chunk,
                            attention_impl=args.attention,
                            dtype=args.dtype or PRESETS[args.preset].dtype)
  print(f"backend={jax.default_backend()} devices={jax.device_count()}"
        f" preset={args.preset} params={cfg.num_params():,} dtype={cfg.dtype}"
        f" remat={cfg.remat} chunk={cfg.attention_chunk}"
        f" attention={cfg.attention_impl}")
  n = args.peak_size
  peak = (args.peak_tflops * 1e12 if args.peak_tflops
          else matmul_rate(n, n, n, cfg.dtype))
  mlp = matmul_rate(args.rows * args.length, cfg.embed_dim, cfg.mlp_dim,
                    cfg.dtype)
  tok_s, flops, mfu, speedup = bench_train(cfg, args.rows, args.length,
                                           peak, args.repeats)
  print(f"matmul peak             {peak / 1e9:10.1f} GFLOP/s")
  print(f"the step's MLP matmul   {mlp / 1e9:10.1f} GFLOP/s alone")
  print(f"train step              {tok_s:10.0f} tokens/s"
        f"  {flops / 1e9:.1f} GFLOP/s  MFU {100 * mfu:.1f}%"
        f"  ({100 * flops / mlp:.0f}% of the MLP matmul's rate)")
  print(f"written-out projection backward {speedup:6.2f}x the train step"
        " with autodiff's")
  cached, baseline = bench_decode(cfg, args.decode_batch, args.prompt_len,
                                  args.new_tokens)
  print(f"decode, KV cache        {cached:10.0f} tokens/s")
  print(f"decode, no-cache reforward {baseline:7.0f} tokens/s")
  print(f"cache speed-up          {cached / baseline:10.2f}x")


if __name__ == "__main__":
  main()
