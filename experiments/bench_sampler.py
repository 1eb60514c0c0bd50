"""Benchmark: the sampler against transformers' ``generate`` on one model.

    python experiments/bench_sampler.py [--size=default|large|long|derive]
        [--repeats=5] [--chunk=64] [--cpu_devices=2]

Both sample the same Llama-shaped model (our random parameters, converted
with ``models.hf``) at temperature 1 with no top-k / top-p and no early
stop, from the same prompts, in this one process, their timed calls
alternating (so both see the same machine); each figure is the median of
``--repeats`` calls after a warm-up (compile and first-call costs excluded
on both sides). Prints both decode rates
(new tokens per second, prefill included) and, as the last line, their
ratio. ``default`` is the built-in model (d=128, 4 layers, vocabulary 58,
untied) at batch 128, 24 + 48 tokens; ``large`` is d=512, 8 layers,
vocabulary 32k at batch 32, 64 + 64; ``long`` the default model at batch
32, 64 + 448 (512 cache slots); ``derive`` the default model at the
shape of ``configs/study.py:imbalanced``'s ``derive`` rollouts, batch
128, 24 + 192 (the decode in three phases). ``--chunk`` gives our model blocked
attention, whose decode reads only the filled part of the cache.
``--cpu_devices`` splits a CPU host into that many devices
(``mesh.cpu_devices``), ours sampling its rows split over them (a data
mesh); transformers keeps its own threads over every core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import parallel
from mopd_jax.models import decoder, hf
from mopd_jax.models.config import ModelConfig
from mopd_jax.rollout import sampler
from mopd_jax.timing import interleaved

SIZES = {
    "default": (ModelConfig(tie_embeddings=False), 128, 24, 48),
    "large": (ModelConfig(vocab_size=32_000, embed_dim=512, num_layers=8,
                          num_heads=8, num_kv_heads=4, head_dim=64,
                          mlp_dim=1536, tie_embeddings=False), 32, 64, 64),
    "long": (ModelConfig(tie_embeddings=False), 32, 64, 448),
    "derive": (ModelConfig(tie_embeddings=False), 128, 24, 192),
    "smoke": (ModelConfig(vocab_size=40, embed_dim=32, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16,
                          mlp_dim=64, tie_embeddings=False), 4, 6, 5),
}


def ours(params, cfg, prompt, new: int):
  """A blocking ``sampler.sample`` call (a new key each call), the rows
  split over every device."""
  mask = jnp.ones_like(prompt)
  sampling = sampler.SamplingConfig(max_new_tokens=new, stop_ids=())
  keys = iter(jax.random.split(jax.random.key(1), 1000))
  mesh = parallel.make_mesh()
  params = jax.device_put(params, parallel.replicated(mesh))

  def run():
    with parallel.use_rules("dp"), parallel.activate(mesh):
      return jax.block_until_ready(sampler.sample(
          params, cfg, prompt, mask, next(keys), sampling))
  return run


def transformers_generate(params, cfg, prompt, new: int):
  """A ``generate`` call on the same weights (torch, float32)."""
  import torch
  import transformers
  config = transformers.AutoConfig.for_model(**hf.hf_config(cfg))
  model = transformers.AutoModelForCausalLM.from_config(
      config, dtype=torch.float32).eval()
  model.load_state_dict({k: torch.from_numpy(np.array(v))
                         for k, v in hf.to_hf(params, cfg).items()})
  ids = torch.from_numpy(np.array(prompt)).long()
  kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                min_new_tokens=new, pad_token_id=0, eos_token_id=None)

  def run():
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
    assert out.shape[1] == ids.shape[1] + new
  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="default", choices=sorted(SIZES))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--batch", type=int, default=0)
  parser.add_argument("--json", default="", help="also write figures here")
  parser.add_argument("--chunk", type=int, default=0,
                      help="our model's attention_chunk (0: dense)")
  parser.add_argument("--cpu_devices", type=int, default=1,
                      help="split the CPU into this many devices")
  args = parser.parse_args()
  parallel.use_cpu_devices(args.cpu_devices)
  cfg, batch, prompt_len, new = SIZES[args.size]
  cfg = dataclasses.replace(cfg, attention_chunk=args.chunk)
  batch = args.batch or batch
  params = decoder.init_params(cfg, jax.random.key(0))
  prompt = jax.random.randint(jax.random.key(2), (batch, prompt_len), 3,
                              cfg.vocab_size)
  tokens = batch * new
  print(f"backend={jax.default_backend()} devices={jax.device_count()}"
        f" size={args.size}"
        f" params={cfg.num_params():,} batch={batch} prompt={prompt_len}"
        f" new={new} {json.dumps(dataclasses.asdict(cfg))}")
  ours_s, theirs_s = interleaved(
      (ours(params, cfg, prompt, new),
       transformers_generate(params, cfg, prompt, new)), args.repeats)
  figures = {"ours_tokens_s": tokens / ours_s,
             "transformers_tokens_s": tokens / theirs_s,
             "ratio": theirs_s / ours_s}
  print(f"mopd_jax sampler        {figures['ours_tokens_s']:10.0f} tokens/s")
  print(f"transformers generate   {figures['transformers_tokens_s']:10.0f}"
        " tokens/s")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=2)
  print(f"ratio (sampler / generate) {figures['ratio']:.2f}x")


if __name__ == "__main__":
  main()
