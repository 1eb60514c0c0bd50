"""Benchmark: one real Hugging Face checkpoint against transformers on the
same weights, in one process (e.g. SmolLM2-135M-Instruct).

    python experiments/bench_real_model.py --model=HF_DIR \
        [--batches=16,64] [--new=128] [--repeats=3] [--cpu_devices=2] \
        [--eval_file=sums.jsonl] [--train_rows=8] [--json=out.json] \
        [--attention_chunk=128] [--unscanned] [--train_processes=3]
        [--keep_logits_mib=0]

Prints, each against its baseline in this one run:
* **sampling**: ours (``sampler.sample``) against transformers' ``generate``
  on chat prompts of 64-128 tokens (the checkpoint's own chat template),
  ``--new`` new tokens at temperature 1 with no early stop, at each batch
  size; timed calls interleaved, medians of ``--repeats`` after a warm-up.
  Our first call (compile included) is reported apart, and our time is
  split into prefill and decode;
* **a train step**: our jitted policy-gradient step (forward, backward,
  AdamW) against a plain torch forward/backward/AdamW step of the same
  model on the same ``--train_rows`` x (prompt + ``--new``) tokens; both
  project only the completion's positions onto the vocabulary, as a GRPO
  or MOPD update does (ours ``sampler.completion_hidden``, torch
  ``logits_to_keep`` as TRL's trainers call it);
* with ``--attention_chunk=N``, both of those also with our blocked
  attention (``model.attention_chunk``: keys in blocks of ``N``, flash
  attention's backward pass), in the same interleaved rounds; with
  ``--unscanned``, the train step also with the layers run as a loop
  instead of one scan (``model.scan_layers=False``); with
  ``--train_processes=N``, each side's train step runs in a fresh process
  of its own instead (ours, then torch's, ``N`` rounds; a process's
  median of ``--repeats`` calls after a warm-up, the median over rounds
  printed): one process allocating for both sides' steps lands their
  multi-GB buffers in each other's heap (docs/performance.md);
  ``--keep_logits_mib=0`` recomputes our vocabulary's logits in the
  backward pass (``ops.keep_logits_mib``; the CPU's default keeps them);
* **evaluate end to end** (with ``--eval_file``, a ``math`` JSONL; its
  first ``--eval_prompts`` test-split records): the wall time of
  ``python -m mopd_jax.evaluate --run=HF_DIR`` (imports, conversion,
  compiles, greedy and sampled decoding) against a transformers loop over
  the same prompts in a fresh process (imports, load, greedy and sampled
  ``generate`` per prompt, stopping at EOS).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCES = (
    "Ada has a basket of apples and gives some to her friends.",
    "Each friend then buys a few more at the market.",
    "The market sells apples in bags of four.",
    "Some of the apples are red and the others are green.",
    "Explain each step of your reasoning before the answer.",
    "Write the final number on the last line.",
)


def chat_prompts(tokenizer, n: int, low: int = 64, high: int = 128,
                 seed: int = 0) -> list[list[int]]:
  """``n`` prompts (token ids through the chat template) of ``low`` to
  ``high`` tokens: random sentences added until the prompt reaches a
  length drawn in that range."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    goal = int(rng.integers(low, high + 1))
    text, ids = "", tokenizer.prompt_ids("")
    while len(ids) < goal:
      candidate = (text + " " + SENTENCES[int(rng.integers(len(SENTENCES)))]
                   ).strip()
      ids_next = tokenizer.prompt_ids(candidate)
      if len(ids_next) > high:
        break
      text, ids = candidate, ids_next
    out.append(ids)
  return out


def left_padded(rows: list[list[int]], pad: int):
  width = max(map(len, rows))
  ids = np.full((len(rows), width), pad, np.int32)
  mask = np.zeros_like(ids)
  for b, row in enumerate(rows):
    ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
  return ids, mask


def our_sampler(cfg, params, ids, mask, new: int):
  """``(first call seconds, run, prefill-only run)``: blocking sampler
  calls over every device's share of the rows."""
  import jax
  from mopd_jax import parallel
  from mopd_jax.rollout import sampler
  sampling = sampler.SamplingConfig(max_new_tokens=new, stop_ids=())
  mesh = parallel.make_mesh()
  params = jax.device_put(params, parallel.replicated(mesh))
  keys = iter(jax.random.split(jax.random.key(1), 1000))

  def run():
    with parallel.use_rules("dp"), parallel.activate(mesh):
      return jax.block_until_ready(sampler.sample(params, cfg, ids, mask,
                                                  next(keys), sampling))

  def prefill():
    with parallel.use_rules("dp"), parallel.activate(mesh):
      p, m = parallel.shard_batch(mesh, (ids, mask))
      return jax.block_until_ready(sampler._prefill(  # pylint: disable=protected-access
          params, cfg, p, m, ids.shape[1] + new))

  start = time.perf_counter()
  run()
  return time.perf_counter() - start, run, prefill


def their_generate(model, ids, mask, new: int):
  import torch
  ids, mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
  kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=0, eos_token_id=None)

  def run():
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
    assert out.shape[1] == ids.shape[1] + new
  return run


def our_train_step(cfg, params, tokens, prompt_len: int,
                   keep_logits_mib: int = -1):
  """A jitted step: ``-mean log pi(y_t)`` over the completion tokens
  (the policy-gradient loss with unit advantages), its gradient, AdamW;
  the vocabulary op over the completion's positions only (its logits kept
  for the backward pass as ``keep_logits_mib`` says, as ``ops``'s)."""
  import jax
  import jax.numpy as jnp
  import optax
  from mopd_jax.models import decoder
  from mopd_jax.ops import vocab
  from mopd_jax.rollout import sampler
  optimizer = optax.adamw(1e-6)
  # a copy of its own: the step donates its state, as the project's
  # updates do
  state = [jax.tree.map(jnp.copy, params), optimizer.init(params)]
  prompt, completion = jnp.split(jnp.asarray(tokens), [prompt_len], axis=1)
  ones = (jnp.ones_like(prompt), jnp.ones_like(completion))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt):
    def loss_fn(p):
      h = sampler.completion_hidden(p, cfg, prompt, ones[0], completion,
                                    ones[1])
      return -jnp.mean(vocab.token_logprobs(
          h, decoder.output_weight(p, cfg), completion,
          ops=vocab.VocabOps(keep_logits_mib=keep_logits_mib)))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = optimizer.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  def run():
    state[0], state[1], loss = step(*state)
    run.losses.append(float(loss))
  run.losses = []
  return run


def their_train_step(model, tokens, prompt_len: int):
  """The same step in torch: logits at the completion's positions only
  (``logits_to_keep``), the mean cross-entropy, backward, AdamW."""
  import torch
  ids = torch.from_numpy(np.asarray(tokens)).long()
  completion = ids[:, prompt_len:]
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

  def run():
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids,
                   logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), completion.reshape(-1))
    loss.backward()
    optimizer.step()
    run.losses.append(float(loss))
  run.losses = []
  return run


def transformers_eval_loop(model_dir: str, eval_file: str, new: int) -> None:
  """What ``evaluate`` does, as a plain transformers loop: every prompt's
  chat text, greedy and sampled ``generate`` one prompt at a time,
  stopping at the checkpoint's EOS."""
  import torch
  import transformers
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      model_dir, dtype=torch.float32).eval()
  for line in open(eval_file, encoding="utf-8"):
    question = json.loads(line)["question"]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)["input_ids"]
    for sample in (True, False):
      with torch.inference_mode():
        model.generate(ids, max_new_tokens=new, do_sample=sample,
                       temperature=1.0 if sample else None, top_k=0 if sample
                       else None, top_p=1.0 if sample else None)


def _wall(cmd) -> float:
  start = time.perf_counter()
  result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS=""))
  if result.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed: {result.stderr[-2000:]}")
  return time.perf_counter() - start


def _side_process(argv: list[str], side: str) -> dict:
  """One side's train step timed in a fresh process: this script's own
  arguments ``argv`` with no sampling, evaluation or JSON and
  ``--train_side``; returns ``{"seconds": median, "calls": [...],
  "loss": the warm-up call's}``."""
  cmd = [sys.executable, os.path.abspath(__file__), *argv, "--batches=",
         "--eval_file=", "--json=", "--train_processes=0",
         f"--train_side={side}"]  # argparse: the last of a flag wins
  result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if result.returncode:
    raise SystemExit(f"train side {side!r} failed: {result.stderr[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_prompts_file(eval_file: str, out_dir: str, n: int) -> str:
  """The first ``n`` records of ``eval_file`` that fall in the test split
  (a record's split is the hash of its prompt), as a file of their own:
  ``evaluate`` grades exactly these, and the loop runs them too."""
  from mopd_jax.data.example import split_of
  kept = []
  for line in open(eval_file, encoding="utf-8"):
    if split_of(json.loads(line)["question"]) == "test" and len(kept) < n:
      kept.append(line)
  path = os.path.join(out_dir, "test_prompts.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(kept)
  return path


def bench_evaluate(model_dir: str, eval_file: str, new: int, out_dir: str,
                   cpu_devices: int, prompts: int):
  """``(ours seconds, transformers seconds, prompts)`` end to end, on the
  test-split records of ``eval_file`` (at most ``prompts``)."""
  eval_file = test_prompts_file(eval_file, out_dir, prompts)
  prompts = sum(1 for _ in open(eval_file, encoding="utf-8"))
  ours = _wall([
      sys.executable, "-m", "mopd_jax.evaluate", f"--run={model_dir}",
      f"--domains=math:{eval_file}", f"--num_prompts={prompts}",
      f"--output={os.path.join(out_dir, 'eval.json')}",
      f"--settings={ROOT}/configs/mix_rl.py",
      "--settings.data.max_prompt_len=512",
      f"--settings.sampling.max_new_tokens={new}",
      f"--settings.mesh.cpu_devices={cpu_devices}"])
  theirs = _wall([sys.executable, os.path.abspath(__file__),
                  f"--model={model_dir}", f"--eval_file={eval_file}",
                  f"--new={new}", "--transformers_eval_loop"])
  return ours, theirs, prompts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True)
  parser.add_argument("--batches", default="16,64",
                      help="sampling batch sizes (empty: no sampling)")
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--prompt_tokens", default="64,128",
                      help="the chat prompts' shortest and longest")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--train_rows", type=int, default=8,
                      help="rows of the train-step comparison (0: none)")
  parser.add_argument("--cpu_devices", type=int, default=1)
  parser.add_argument("--eval_file", default="")
  parser.add_argument("--eval_new", type=int, default=160)
  parser.add_argument("--eval_prompts", type=int, default=24,
                      help="test-split records of --eval_file evaluated")
  parser.add_argument("--attention_chunk", type=int, default=0,
                      help="also time ours with blocked attention")
  parser.add_argument("--unscanned", action="store_true",
                      help="also time our train step with"
                      " model.scan_layers=False")
  parser.add_argument("--keep_logits_mib", type=int, default=-1,
                      help="our train step's ops.keep_logits_mib (0: the"
                      " vocabulary's logits recomputed in the backward)")
  parser.add_argument("--train_processes", type=int, default=0,
                      help="rounds of the train steps, each side in a"
                      " process of its own (0: interleaved in this one)")
  parser.add_argument("--json", default="")
  parser.add_argument("--transformers_eval_loop", action="store_true",
                      help=argparse.SUPPRESS)
  parser.add_argument("--train_side", default=None, help=argparse.SUPPRESS)
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if args.transformers_eval_loop:
    return transformers_eval_loop(args.model, args.eval_file, args.new)
  from mopd_jax import parallel
  parallel.use_cpu_devices(args.cpu_devices)
  import jax
  import torch
  import transformers
  from mopd_jax import convert, runs
  from mopd_jax.models import tokenizer as tokenizer_lib
  from mopd_jax.timing import interleaved, timed, timed_calls
  tok = tokenizer_lib.of_run(args.model)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.model, dtype=torch.float32).eval()
  low, high = map(int, args.prompt_tokens.split(","))
  figures = {"devices": jax.device_count(), "new": args.new}
  with contextlib.ExitStack() as stack:
    run_dir = stack.enter_context(convert.as_run(args.model))
    cfg, params = runs.final_model(run_dir)
    print(f"backend={jax.default_backend()} devices={jax.device_count()}"
          f" params={cfg.num_params():,} layers={cfg.num_layers}"
          f" vocab={cfg.vocab_size}")
    # ours as converted (dense attention), and blocked if asked for
    ours_cfgs = {"": cfg}
    if args.attention_chunk:
      ours_cfgs[f"_chunk{args.attention_chunk}"] = dataclasses.replace(
          cfg, attention_chunk=args.attention_chunk)
    # the train step also with the layers as a loop (the sampler runs with
    # a KV cache, which scan_layers does not change)
    train_cfgs = dict(ours_cfgs)
    if args.unscanned:
      train_cfgs["_unscanned"] = dataclasses.replace(cfg, scan_layers=False)
    for batch in [int(b) for b in args.batches.split(",") if b]:
      ids, mask = left_padded(chat_prompts(tok, batch, low, high),
                              tok.pad_id)
      samplers = {k: our_sampler(c, params, ids, mask, args.new)
                  for k, c in ours_cfgs.items()}
      *ours_s, theirs_s = interleaved(
          [run for _, run, _ in samplers.values()]
          + [their_generate(model, ids, mask, args.new)], args.repeats)
      tokens = batch * args.new
      for (key, (first, _, prefill)), mine in zip(samplers.items(), ours_s):
        prefill_s = timed(prefill, args.repeats)
        figures[f"sample_b{batch}{key}"] = row = dict(
            prompt_tokens=int(mask.sum()), width=int(ids.shape[1]),
            ours_tokens_s=tokens / mine, theirs_tokens_s=tokens / theirs_s,
            ratio=theirs_s / mine, first_call_s=first, ours_s=mine,
            prefill_s=prefill_s, decode_s=mine - prefill_s)
        print(f"batch {batch:3d}{key}: sampler {row['ours_tokens_s']:7.0f}"
              f" tokens/s, generate {row['theirs_tokens_s']:7.0f}:"
              f" {row['ratio']:.2f}x (first call {first:.1f} s with compile;"
              f" prefill {prefill_s:.2f} s + decode {mine - prefill_s:.2f} s)")
    if args.train_rows:  # 0: no train-step comparison
      prompts = left_padded(chat_prompts(tok, args.train_rows, low, high),
                            tok.pad_id)[0]
      prompt_len = prompts.shape[1]
      completions = np.random.default_rng(3).integers(
          3, tok.vocab_size, (args.train_rows, args.new), dtype=np.int32)
      tokens = np.concatenate([prompts, completions], axis=1)
      sides = [*train_cfgs, "torch"]

      def step_of(side):
        if side == "torch":
          return their_train_step(model.train(), tokens, prompt_len)
        return our_train_step(train_cfgs[side], params, tokens, prompt_len,
                              args.keep_logits_mib)

      if args.train_side is not None:  # a child of --train_processes
        fn = step_of(args.train_side)
        calls = timed_calls(fn, args.repeats)
        print(json.dumps(dict(seconds=float(np.median(calls)), calls=calls,
                              loss=fn.losses[0])))
        return
      if args.train_processes:
        rounds = [[_side_process(argv, side) for side in sides]
                  for _ in range(args.train_processes)]
        *ours_s, theirs_s = (float(np.median([r[i]["seconds"] for r in rounds]))
                             for i in range(len(sides)))
        first = [r["loss"] for r in rounds[0]]
      else:
        steps = [step_of(side) for side in sides]
        *ours_s, theirs_s = interleaved(steps, args.repeats)
        first = [fn.losses[0] for fn in steps]
      # the same loss on the same weights (the warm-up calls): the two
      # sides compute one step
      if max(first) - min(first) > 1e-3 * abs(first[-1]):
        raise SystemExit(f"the train steps' losses differ: {first}")
      n = tokens.size
      for i, (key, mine) in enumerate(zip(train_cfgs, ours_s)):
        figures[f"train_step{key}"] = row = dict(
            tokens=n, ours_tokens_s=n / mine, theirs_tokens_s=n / theirs_s,
            ratio=theirs_s / mine)
        if args.train_processes:  # every timed call, per round and side
          row.update(ours_calls=[r[i]["calls"] for r in rounds],
                     theirs_calls=[r[-1]["calls"] for r in rounds])
        where = (f", {args.train_processes} rounds of a process each"
                 if args.train_processes else "")
        print(f"train step{key} ({args.train_rows} x {tokens.shape[1]}"
              f"{where}): ours {row['ours_tokens_s']:.0f} tokens/s, torch"
              f" {row['theirs_tokens_s']:.0f}: {row['ratio']:.2f}x")
  if args.eval_file:
    out_dir = os.path.dirname(os.path.abspath(args.json or args.eval_file))
    ours_s, theirs_s, n = bench_evaluate(args.model, args.eval_file,
                                         args.eval_new, out_dir,
                                         args.cpu_devices, args.eval_prompts)
    figures["evaluate"] = dict(prompts=n, new=args.eval_new, ours_s=ours_s,
                               theirs_s=theirs_s, ratio=theirs_s / ours_s)
    print(f"evaluate end to end ({n} prompts, greedy and sampled,"
          f" {args.eval_new} new tokens): ours {ours_s:.1f} s, transformers"
          f" loop {theirs_s:.1f} s: {theirs_s / ours_s:.2f}x")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=2)


if __name__ == "__main__":
  main()
