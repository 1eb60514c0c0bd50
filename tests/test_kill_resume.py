"""SIGKILL a smoke run at several moments, re-run the same command each time:
the run ends with the same parameters (checksum), metrics and evaluation as
one never stopped, and its log has no duplicated or missing lines."""

import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT, pretrain_smoke_command


def _records(run) -> list[dict]:
  """metrics.jsonl without timings; lines still being written are skipped."""
  path = os.path.join(run, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  out = []
  for line in open(path, encoding="utf-8"):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    record.pop("steps_per_sec", None)
    out.append(record)
  return out


def _logged(run, step):
  return lambda: any(r["step"] >= step for r in _records(run))


def _saving(run):
  """True while Orbax writes a checkpoint (its temporary directory)."""
  def ready():
    names = os.listdir(os.path.join(run, "ckpt")) if os.path.isdir(
        os.path.join(run, "ckpt")) else []
    return any("tmp" in n for n in names)
  return ready


def _checkpointed(run, step):
  return lambda: os.path.isdir(os.path.join(run, "ckpt", str(step)))


def _either(*conditions):
  return lambda: any(c() for c in conditions)


def _signal_when(cmd, ready, env, sig, timeout=240):
  """Run ``cmd``; send it ``sig`` as soon as ``ready()`` holds. Returns its
  exit code and stderr."""
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    if ready():
      proc.send_signal(sig)
      break
    time.sleep(0.005)
  _, err = proc.communicate(timeout=timeout)
  return proc.returncode, err


def _kill_when(cmd, ready, env, timeout=240):
  """Run ``cmd``; SIGKILL it as soon as ``ready()`` holds. Returns its exit
  code (-9 when killed)."""
  code, err = _signal_when(cmd, ready, env, signal.SIGKILL, timeout)
  assert code in (0, -signal.SIGKILL), err[-3000:]
  return code


def _assert_same_run(run, reference):
  assert _records(run) == _records(reference)
  for name in ("summary.json", "eval.json"):
    assert json.load(open(os.path.join(run, name))) == json.load(
        open(os.path.join(reference, name))), name
  # keep=2; a killed save's temporary directory, if Orbax has not yet
  # removed it, is not a checkpoint
  steps = [n for n in os.listdir(os.path.join(run, "ckpt")) if "tmp" not in n]
  assert sorted(steps) == ["2", "4"]


def test_pretrain_killed_twice_ends_identical(smoke_run, data_dir, tmp_path,
                                              cached_env):
  reference = smoke_run[0]
  run = tmp_path / "run"
  cmd = pretrain_smoke_command(run, data_dir)
  kills = [
      # step 4 logged and being evaluated, before its checkpoint: back to 2
      _logged(run, 4),
      # the last checkpoint complete, the summary not yet written
      _checkpointed(run, 4),
  ]
  codes = [_kill_when(cmd, ready, cached_env) for ready in kills]
  assert codes == [-signal.SIGKILL] * 2, codes
  assert _kill_when(cmd, lambda: False, cached_env) == 0
  _assert_same_run(run, reference)


def _mix_rl_command(run, base, data_dir):
  return [sys.executable, "-m", "mopd_jax.train",
          f"--config={ROOT}/configs/mix_rl.py:smoke", f"--workdir={run}",
          f"--config.init={base}", f"--config.data.data_dir={data_dir}",
          # one evaluation, at the end, on one domain: fewer programs to
          # compile
          "--config.train.eval_every=0", "--config.eval.greedy=False",
          "--config.eval.domains=('add',)"]


def test_mix_rl_killed_twice_ends_identical(smoke_run, data_dir, tmp_path,
                                            cached_env):
  """Adaptive mixture state, prompt draws and minibatch shuffles included."""
  cmd = lambda run: _mix_rl_command(run, smoke_run[0], data_dir)  # noqa: E731
  reference, run = tmp_path / "reference", tmp_path / "run"
  assert _kill_when(cmd(reference), lambda: False, cached_env) == 0
  kills = [
      # while the first checkpoint is written (or soon after)
      _either(_saving(run), _logged(run, 2)),
      # the checkpoint of step 2 complete: resume from it
      _checkpointed(run, 2),
  ]
  codes = [_kill_when(cmd(run), ready, cached_env) for ready in kills]
  assert codes == [-signal.SIGKILL] * 2, codes
  assert _kill_when(cmd(run), lambda: False, cached_env) == 0
  _assert_same_run(run, reference)


def test_sigterm_and_ctrl_c_checkpoint_the_step_and_resume_identical(
    data_dir, tmp_path, cached_env):
  """A Ctrl-C (SIGINT), then a preemption's SIGTERM, each end the run after
  its current step with a checkpoint of it and one line; the same command
  then finishes it as if never stopped."""
  def cmd(run):
    return pretrain_smoke_command(run, data_dir) + [
        "--config.train.steps=12", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.checkpoint.every=100"]
  reference, run = tmp_path / "reference", tmp_path / "run"
  assert _kill_when(cmd(reference), lambda: False, cached_env) == 0
  stopped = 0
  for sig in (signal.SIGINT, signal.SIGTERM):
    code, err = _signal_when(cmd(run), _logged(run, stopped + 2), cached_env,
                             sig)
    assert code == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: stopped by {signal.Signals(sig).name}"
                           " after step ") and line.endswith(
                               "its checkpoint saved; run the same command"
                               " to resume"), line
    assert "Traceback" not in err
    step = int(line.split("after step ")[1].split(",")[0])
    assert stopped + 2 <= step < 12
    assert os.path.isdir(run / "ckpt" / str(step))
    stopped = step
  assert _kill_when(cmd(run), lambda: False, cached_env) == 0
  assert _records(run) == _records(reference)
  for name in ("summary.json", "eval.json"):
    assert json.load(open(run / name)) == json.load(open(reference / name))

