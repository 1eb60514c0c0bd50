"""The real entry point on the smoke config: trains, checkpoints, evaluates,
writes metrics, and a re-run of the same command resumes instead of restarting.
The notebook in colabs/ runs on what it wrote."""

import json
import os
import subprocess

import matplotlib

from conftest import ROOT


def test_pretrain_smoke_writes_everything(smoke_run):
  run, _, first = smoke_run
  assert "evaluation at step 4" in first.stdout
  assert "evaluation at step 2" in first.stdout  # train.eval_every=2
  for domain in ("add", "chain", "instruct", "sort", "reverse"):
    assert domain in first.stdout
  assert sorted(os.listdir(run / "ckpt")) == ["2", "4"]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 2 and all(l > 0 for l in losses)
  assert sum("eval/greedy/add/accuracy" in r for r in records) == 2
  assert os.listdir(run / "tb")
  result = json.load(open(run / "eval.json"))
  assert 0.0 <= result["eval/sampled/reverse/accuracy"] <= 1.0


def test_rerun_resumes_from_latest_checkpoint(smoke_run):
  run, cmd, _ = smoke_run
  second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resuming from step 4" in second.stdout
  assert sorted(os.listdir(run / "ckpt")) == ["2", "4"]


def test_colab_notebook_runs_on_the_workdir(smoke_run, monkeypatch):
  matplotlib.use("Agg")
  monkeypatch.setattr("matplotlib.pyplot.show", lambda: None)
  notebook = json.load(open(os.path.join(ROOT, "colabs",
                                         "inspect_run.ipynb")))
  scope = {}
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      source = "".join(cell["source"])
      if source.startswith("# In Colab"):
        scope["WORKDIR"] = str(smoke_run[0])
        continue
      exec(compile(source, "inspect_run.ipynb", "exec"), scope)  # noqa: S102
  assert len(scope["train"]) == 2 and len(scope["evals"]) == 2
  assert ("greedy", "add") in scope["series"]
