"""Every benchmark script runs end to end on tiny shapes (so none can rot
unseen: bench_step broke once on a hand-made optimiser config), printing
its ratios."""

import json

from conftest import ROOT, run_experiment, train_cli


def test_bench_step_smoke():
  # The accelerator settings: bfloat16, remat, blocked attention.
  result = run_experiment("bench_step.py", "--preset=micro", "--rows=2",
                          "--length=8", "--decode_batch=2", "--prompt_len=4",
                          "--new_tokens=2", "--peak_size=64",
                          "--dtype=bfloat16", "--remat", "--chunk=4",
                          "--attention=cudnn", "--repeats=2")
  assert result.returncode == 0, result.stderr[-3000:]
  assert ("dtype=bfloat16 remat=True chunk=4 attention=cudnn"
          in result.stdout)
  for line in ("train step", "MLP matmul", "projection backward",
               "decode, KV cache", "cache speed-up"):
    assert line in result.stdout, line


def test_bench_ops_smoke():
  result = run_experiment("bench_ops.py", "--n=64", "--d=16", "--v=128",
                          "--repeats=1", "--keep_logits_mib=0")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "max rel err" in result.stdout and '"memory_ratio"' in result.stdout


def test_bench_sampler_smoke(tmp_path):
  out = tmp_path / "sampler.json"
  result = run_experiment("bench_sampler.py", "--size=smoke", "--repeats=1",
                          "--chunk=4", "--cpu_devices=2", f"--json={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "devices=2" in result.stdout
  assert result.stdout.strip().splitlines()[-1].startswith(
      "ratio (sampler / generate)")
  figures = json.loads(out.read_text())
  assert figures["ours_tokens_s"] > 0 and figures["transformers_tokens_s"] > 0


def test_bench_mopd_smoke(tmp_path, data_dir, smoke_run):
  out = tmp_path / "mopd.json"
  result = run_experiment("bench_mopd.py", "--steps=3",
                          f"--out={tmp_path / 'runs'}",
                          f"--data_dir={data_dir}", f"--json={out}",
                          f"--base={smoke_run[0]}", "--teachers=2",
                          "--cpu_devices=2")
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  assert "ratio per completion token (TRL / ours)" in (
      result.stdout.strip().splitlines()[-1])
  figures = json.loads(out.read_text())
  for name in ("trl_1_teacher", "ours_2_teachers"):
    assert figures[name]["seconds"] > 0 and figures[name]["tokens"] > 0
  assert figures["ratio"]["2"] > 0
  summary = json.loads((tmp_path / "runs" / "mopd_2_add" / "summary.json"
                        ).read_text())
  assert summary["devices"] == 2  # mesh.cpu_devices, not the 8 of XLA_FLAGS


def test_bench_real_model_and_real_data_smoke(tmp_path):
  """On a tiny Llama checkpoint with a chat template, as transformers
  saves one; the data files of experiments/real_data.py as the eval file."""
  import torch
  import transformers
  from test_hf_tokenizer import save_tokenizer
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=128, hidden_size=32, intermediate_size=48,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=8)).to(torch.float32)
  model.save_pretrained(tmp_path / "hf")
  save_tokenizer(tmp_path / "hf")
  result = run_experiment("real_data.py", f"--out={tmp_path / 'data'}",
                          "--n=40")
  assert result.returncode == 0, result.stderr[-3000:]
  sums = tmp_path / "data" / "sums.jsonl"
  assert len(sums.read_text().splitlines()) == 40
  out = tmp_path / "real.json"
  result = run_experiment("bench_real_model.py", f"--model={tmp_path / 'hf'}",
                          "--batches=2", "--new=3", "--repeats=1",
                          "--train_rows=2", "--prompt_tokens=8,16",
                          f"--eval_file={sums}", "--eval_new=3",
                          "--eval_prompts=2", f"--json={out}",
                          "--attention_chunk=4", "--unscanned")
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(out.read_text())
  for key in ("sample_b2", "train_step", "sample_b2_chunk4",
              "train_step_chunk4", "train_step_unscanned", "evaluate"):
    assert figures[key]["ratio"] > 0, key
  assert figures["evaluate"]["prompts"] == 2  # test-split records only
  assert figures["sample_b2"]["first_call_s"] > 0
  # each side's train step in a process of its own
  result = run_experiment("bench_real_model.py", f"--model={tmp_path / 'hf'}",
                          "--batches=", "--new=3", "--repeats=1",
                          "--train_rows=2", "--prompt_tokens=8,16",
                          "--train_processes=1", "--keep_logits_mib=0",
                          f"--json={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "1 rounds of a process each" in result.stdout
  assert json.loads(out.read_text())["train_step"]["ratio"] > 0


def test_bench_async_smoke_and_the_async_run_resumes_exactly(tmp_path,
                                                             data_dir,
                                                             smoke_run,
                                                             cached_env):
  """The benchmark's two runs, and its async one killed before its last
  checkpoint and re-run: the in-flight batch was checkpointed with the
  state, so it ends with the same parameters and metrics."""
  import shutil
  out = tmp_path / "bench"
  result = run_experiment(  # the re-run loads what the run compiled
      "bench_async.py", "--steps=4", f"--out={out}", f"--data_dir={data_dir}",
      f"--base={smoke_run[0]}", "--variant=smoke",
      f"--json={tmp_path / 'async.json'}", env=cached_env)
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  assert "ratio sync / async per step" in result.stdout.splitlines()[-1]
  figures = json.loads((tmp_path / "async.json").read_text())
  assert figures["lag_0"] > 0 and figures["lag_1"] > 0
  run = out / "mopd_lag1"
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["policy_lag"] for r in records if "policy_lag" in r][-1] == 1.0
  summary = json.loads((run / "summary.json").read_text())
  assert summary["devices"] == 2  # one trains, one samples
  config = json.loads((run / "config.json").read_text())
  shutil.rmtree(run / "ckpt" / "4")
  (run / "summary.json").unlink()
  rerun = train_cli(
      f"--config={ROOT}/configs/mopd.py:smoke", f"--workdir={run}",
      f"--config.init={config['init']}",
      f"--config.teachers={config['teachers']}",
      "--config.rl.max_policy_lag=1", "--config.rl.tis_cap=2.0",
      "--config.train.steps=4", "--config.train.log_every=1",
      "--config.train.eval_every=0", "--config.eval.num_prompts=8",
      "--config.checkpoint.every=2", "--config.mesh.cpu_devices=2",
      f"--config.data.data_dir={data_dir}", env=cached_env)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "resuming from step 2" in rerun.stdout + rerun.stderr
  assert json.loads((run / "summary.json").read_text())["params_sha256"] == (
      summary["params_sha256"])
  again = [json.loads(l) for l in open(run / "metrics.jsonl")]
  for r in records + again:
    r.pop("steps_per_sec", None)
  assert again == records


def test_bench_length_buckets_smoke():
  result = run_experiment("bench_length_buckets.py", "--preset=micro",
                          "--rows=8", "--width=16", "--prompt_len=4",
                          "--long=12", "--minibatches=1", "--epochs=1",
                          "--buckets=2", "--repeats=1")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert lines[-1].startswith("ratio (1 part / 2 parts)")
  assert "length_buckets=2" in result.stdout


def test_bench_sampling_budgets_smoke():
  result = run_experiment("bench_sampling_budgets.py", "--preset=micro",
                          "--rows=8", "--prompt_len=4", "--short=2",
                          "--long=8", "--repeats=1")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().splitlines()[-1].startswith(
      "ratio (one call / by budget)")
