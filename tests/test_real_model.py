"""A real instruct checkpoint end to end: SmolLM2-135M-Instruct (Llama, 30
layers, ChatML) against transformers on the same weights: the chat
prompts it renders, per-token log-probs of chat and plain lines, greedy
tokens, export and reload, and one GRPO, one MOPD and one merge run
through the ordinary command lines (each its own test, so that the
pytest-xdist workers share them; the checkpoint is converted once per
session)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import python_m, train_cli  # noqa: E402
from mopd_jax import convert, runs  # noqa: E402
from mopd_jax.data import batching  # noqa: E402
from mopd_jax.models import tokenizer as tokenizer_lib  # noqa: E402
from mopd_jax.rollout import sampler  # noqa: E402

PROMPTS = ("What is 12 + 30?", "Write one word in capital letters.",
           "Name a colour.", "Say hi to Ada, then stop.")


@pytest.fixture(scope="module")
def theirs(smollm2_hf):
  """transformers' model and tokenizer of the checkpoint."""
  model = transformers.AutoModelForCausalLM.from_pretrained(
      smollm2_hf, dtype=torch.float32).eval()
  return model, transformers.AutoTokenizer.from_pretrained(smollm2_hf)


def _chat_ids(tokenizer, prompt):
  ids = tokenizer.apply_chat_template(
      [{"role": "user", "content": prompt}], add_generation_prompt=True,
      tokenize=True)
  return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(
      ids, "keys") else ids)


def _their_logprobs(model, ids):
  """log softmax of transformers' logits at every position of ``ids``."""
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].double()
  return torch.log_softmax(logits, -1).numpy()


def test_chat_prompts_render_as_transformers_renders_them(smollm2_hf,
                                                          theirs):
  _, their_tok = theirs
  ours = tokenizer_lib.of_run(smollm2_hf)
  assert ours.template is not None  # found in chat_template.jinja
  assert ours.stop_ids == (2,) and ours.eos_id == 2
  for prompt in PROMPTS:
    ids = ours.prompt_ids(prompt)
    assert ids == _chat_ids(their_tok, prompt)
    assert their_tok.decode(ids).startswith("<|im_start|>system\n")
  # A completion: up to its first stop token, special tokens dropped.
  blue = ours.encode("Blue")
  assert ours.decode([1] + blue + [2, 5, 6]) == their_tok.decode(
      [1] + blue, skip_special_tokens=True) == "Blue"


def test_score_on_the_checkpoint_matches_transformers(tmp_path, smollm2_hf,
                                                      theirs):
  """``score --model=<checkpoint dir>``: chat-formatted prompt/completion
  lines and plain text, to 1e-4 of transformers' log-probs; nothing is
  written into the checkpoint."""
  model, their_tok = theirs
  lines = [{"prompt": PROMPTS[0], "completion": "12 + 30 = 42."},
           {"prompt": PROMPTS[2], "completion": "Blue"},
           {"text": "The capital of France is Paris."}]
  path = tmp_path / "in.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  before = sorted(os.listdir(smollm2_hf))
  out = tmp_path / "out.jsonl"
  result = python_m("mopd_jax.score", f"--model={smollm2_hf}",
                    f"--input={path}", f"--output={out}", timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert sorted(os.listdir(smollm2_hf)) == before
  records = [json.loads(r) for r in out.read_text().splitlines()]
  for line, record in zip(lines, records):
    if "text" in line:
      ids = their_tok(line["text"])["input_ids"]
      first = 1
    else:
      prompt = _chat_ids(their_tok, line["prompt"])
      ids = prompt + their_tok(line["completion"], add_special_tokens=False
                               )["input_ids"] + [their_tok.eos_token_id]
      first = len(prompt)
    assert record["tokens"] == ids[first:]
    want = _their_logprobs(model, ids)[np.arange(first - 1, len(ids) - 1),
                                       ids[first:]]
    np.testing.assert_allclose(record["logprobs"], want, atol=1e-4)
  assert records[0]["pieces"][-1] == "<|im_end|>"


def test_greedy_tokens_are_transformers_greedy_tokens(smollm2_run, theirs):
  model, _ = theirs
  tok = tokenizer_lib.of_run(smollm2_run)
  cfg, params = runs.final_model(smollm2_run)
  tokens, mask = batching.encode_prompts(PROMPTS, tok, 128, fit=True)
  greedy = sampler.SamplingConfig(max_new_tokens=32, temperature=0.0,
                                  stop_ids=tok.stop_ids, pad_id=tok.pad_id)
  rollout = sampler.sample(params, cfg, jnp.asarray(tokens),
                           jnp.asarray(mask), jax.random.key(0), greedy)
  for row, prompt in enumerate(PROMPTS):
    ids = torch.tensor([tok.prompt_ids(prompt)])
    with torch.no_grad():
      want = model.generate(ids, max_new_tokens=32, do_sample=False
                            )[0, ids.shape[1]:].tolist()
    got = np.asarray(rollout.completion[row])
    assert got[:int(np.asarray(rollout.mask[row]).sum())].tolist() == want


def test_export_reloads_in_transformers_with_its_logits_and_chat(
    tmp_path, smollm2_run, theirs):
  model, their_tok = theirs
  out = tmp_path / "exported"
  convert.export_run(smollm2_run, str(out))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32).eval()
  reloaded_tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = _chat_ids(their_tok, PROMPTS[1]) + [504, 1690, 2]
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(torch.tensor([ids])).logits,
                                  model(torch.tensor([ids])).logits)
  for prompt in PROMPTS:
    assert _chat_ids(reloaded_tok, prompt) == _chat_ids(their_tok, prompt)
  generation = json.loads((out / "generation_config.json").read_text())
  assert generation["eos_token_id"] in (2, [2])


def _math_file(path, n=120):
  """Templated arithmetic word problems with exact answers."""
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(n):
      a, b = (int(x) for x in rng.integers(2, 40, 2))
      f.write(json.dumps({
          "question": f"Ada has {a} apples and buys {b} more. How many"
                      " apples does she have now?",
          "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
  return str(path)


# The commands run on the one CPU device a user's machine has (not the
# suite's 8: a batch of 4 sequences is allowed) and compile as the rest of
# the suite does (conftest.py): XLA's default optimisations cost the
# GRPO step's command 27 s against 23 alone.
# A GRPO or MOPD step as small as the real model allows on two cores (the
# prompts' ChatML with SmolLM2's system line is about 55 tokens: a width of
# 64 holds them, and a step at 128 took twice as long). The evaluation's 4
# prompts of the file's test split (hashed: 1 line in 10, 13 of these 120)
# are the rollout's 4 rows, so it runs the sampler the rollout compiled.
TINY = ("--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
        "--config.rl.minibatches=1", "--config.sampling.max_new_tokens=8",
        "--config.data.max_prompt_len=64", "--config.train.steps=1",
        "--config.train.eval_every=0", "--config.eval.num_prompts=4",
        "--config.eval.batch_size=4", "--config.eval.greedy=False",
        "--config.checkpoint.every=1")


def test_a_grpo_step_then_a_mopd_step_with_its_result_as_teacher(
    tmp_path, smollm2_run, cached_env):
  """One GRPO step on the real model, then one MOPD step from that run with
  itself as the teacher, in turn (the second run loads the sampler and
  evaluation programs the first compiled: ``cached_env`` keeps every
  compile; 45 s against 61 alone). The MOPD KL is 0 at step 0, to
  the float32 rounding between the teacher's scoring pass and the
  student's own (measured: 4e-7 for the exact KL, 7e-7 per sampled
  token)."""
  domain = "math:" + _math_file(tmp_path / "sums.jsonl")
  grpo = tmp_path / "grpo"
  result = train_cli("--config=configs/grpo.py", f"--workdir={grpo}",
                     f"--config.init={smollm2_run}",
                     f"--config.domain={domain}", "--config.stop.gain=0",
                     f"--config.eval.domains=('{domain}',)", *TINY,
                     timeout=900, env=cached_env)
  assert result.returncode == 0, result.stderr[-2000:]
  assert runs.finished(grpo)
  assert runs.final_model(grpo)[0].num_layers == 30
  mopd = tmp_path / "mopd"
  result = train_cli("--config=configs/mopd.py", f"--workdir={mopd}",
                     f"--config.init={grpo}",
                     f"--config.teachers={domain}={grpo}",
                     f"--config.data.domains=('{domain}',)",
                     f"--config.eval.domains=('{domain}',)", *TINY,
                     timeout=900, env=cached_env)
  assert result.returncode == 0, result.stderr[-2000:]
  first = json.loads((mopd / "metrics.jsonl").read_text().splitlines()[0])
  assert abs(first["loss"]) < 1e-5 and abs(first["signal"]) < 1e-5, first
  assert runs.finished(mopd)


def test_a_data_free_merge_of_the_model_and_a_perturbed_copy(
    tmp_path, smollm2_hf, smollm2_run):
  from safetensors.numpy import load_file, save_file
  copy = tmp_path / "perturbed"
  copy.mkdir()
  for name in os.listdir(smollm2_hf):
    if name != "model.safetensors":
      (copy / name).write_bytes((open(os.path.join(smollm2_hf, name), "rb")
                                 ).read())
  tensors = load_file(os.path.join(smollm2_hf, "model.safetensors"))
  rng = np.random.default_rng(0)
  for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
    tensors[name] = tensors[name] + 0.01 * rng.standard_normal(
        tensors[name].shape).astype(np.float32)
  save_file(tensors, str(copy / "model.safetensors"))
  expert = str(tmp_path / "expert")
  convert.import_hf(str(copy), expert)
  merged = tmp_path / "merged"
  result = train_cli("--config=configs/merge.py", f"--workdir={merged}",
                     f"--config.init={smollm2_run}",
                     f"--config.experts={expert},{smollm2_run}",
                     "--config.merge.lambda=0.5",
                     "--config.merge.geometry=False", timeout=900)
  assert result.returncode == 0, result.stderr[-2000:]
  cfg, params = runs.final_model(merged)
  assert cfg.num_layers == 30 and runs.finished(merged)
  assert not (merged / runs.EVAL_FILE).exists()  # no data, no evaluation
  assert not (merged / "geometry.json").exists()  # not asked for
  # task arithmetic at lambda 0.5 of (perturbation, 0): half the noise
  base = load_file(os.path.join(smollm2_hf, "model.safetensors"))
  want = base["model.norm.weight"] + 0.5 * (
      tensors["model.norm.weight"] - base["model.norm.weight"])
  np.testing.assert_allclose(np.asarray(params["final_norm"]), want,
                             atol=1e-6)
