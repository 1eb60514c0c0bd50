"""The fusion study: the smoke study end to end (schema, report, figures,
cached re-run), and each new statistic against hand-computed values."""

import json
import math
import os

import jax
import pytest

from conftest import ROOT, load_config, math_file, run_notebook, train_cli
from mopd_jax import runs, stages
from mopd_jax.errors import CheckpointError, ConfigError
from mopd_jax.evaluation import costs, report
from mopd_jax.stages import study as study_stage

# Its module-scoped fixture is built once: every test of the module on one
# pytest-xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("study")

MODELS = ("base", "expert/add", "expert/chain", "expert/instruct",
          "expert/sort", "merge/ties", "mix_rl",
          "mopd", "open_mopd", "oracle")


@pytest.fixture(scope="module")
def study(tmp_path_factory, data_dir, cached_env, smoke_run):
  """The smoke study on the session's smoke base (plugged in)."""
  workdir = tmp_path_factory.mktemp("study") / "run"
  before = sorted(p.name for p in smoke_run[0].iterdir())
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke",
                     f"--workdir={workdir}", f"--config.base={smoke_run[0]}",
                     f"--config.data_dir={data_dir}", env=cached_env,
                     timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  # A plugged-in run is only read: its evaluations live in the study.
  assert sorted(p.name for p in smoke_run[0].iterdir()) == before
  return workdir, result


def test_smoke_study_writes_the_results_schema(study):
  workdir, result = study
  results = json.loads((workdir / "results.json").read_text())
  assert results["domains"] == ["add", "chain", "instruct", "sort"]
  assert results["held_out"] == ["reverse"]
  assert set(results["methods"]) == set(MODELS)
  for name, entry in results["methods"].items():
    for key in ("accuracy", "pass_at_k", "headroom_recovery", "retention",
                "cost", "stderr", "sampled_accuracy"):
      assert key in entry, (name, key)
    assert set(entry["accuracy"]) >= set(results["domains"])
    # smoke models answer nothing: no headroom anywhere, so null, not 0
    assert entry["headroom_recovery"]["mean"] is None
    assert entry["pass_at_k"]["add"] and set(entry["pass_at_k"]["add"]) == {
        "1", "2"}
  assert results["methods"]["mopd"]["cost"]["tokens_teacher_scored"] > 0
  assert "with_experts" in results["methods"]["merge/ties"]["cost"]
  cosine = results["task_vectors"]["cosine"]
  assert set(cosine) == set(results["domains"])
  assert set(results["transfer"]["add"]) == {"add", "chain", "instruct",
                                             "sort", "reverse"}
  assert results["recommendation"]["text"]
  assert "study [1/18] expert add" in result.stdout


def test_report_and_figures(study):
  workdir, _ = study
  text = (workdir / "report.md").read_text()
  for section in ("# Fusion study", "## Recommendation",
                  "## Between paradigms", "## Coverage (pass@k)",
                  "## Geometry and transfer", "## Training dynamics",
                  "## Cost"):
    assert section in text, section
  for png in ("accuracy.png", "pass_at_k.png", "geometry_transfer.png",
              "dynamics.png"):
    assert (workdir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert f"({png})" in text


def test_fusion_study_notebook_runs_on_the_study(study, monkeypatch):
  workdir, _ = study
  monkeypatch.setattr("matplotlib.pyplot.show", lambda: None)
  scope = run_notebook("fusion_study.ipynb", workdir)
  assert set(scope["rows"]) == set(MODELS)
  assert set(scope["curves"]) == {"mix_rl", "mopd", "open_mopd"}


def test_rerun_skips_finished_steps(study, data_dir, cached_env, smoke_run):
  workdir, _ = study
  base = smoke_run[0]
  before = (workdir / "results.json").read_text()
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke",
                     f"--workdir={workdir}", f"--config.base={base}",
                     f"--config.data_dir={data_dir}", env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("finished before") == 8  # every run
  assert (workdir / "results.json").read_text() == before


def test_a_seeded_study_on_the_smoke_studys_experts(study, data_dir,
                                                    cached_env, smoke_run):
  """Two seeds of Merge and Mix RL on the smoke study's experts: each seed
  its own one-seed study (every step's seed set), the report over seeds
  with intervals and paired differences; the shared base and experts are
  only read."""
  experts = f"{study[0]}/expert_{{domain}}"
  workdir = study[0].parent / "seeded"
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke_seeds",
                     f"--workdir={workdir}", f"--config.base={smoke_run[0]}",
                     f"--config.experts={experts}",
                     "--config.steps=('merge','mix_rl','mopd_from_merge',"
                     "'evaluate','report')",
                     "--config.seed_processes=2",
                     f"--config.data_dir={data_dir}", env=cached_env,
                     timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["seeds"] == [0, 1] and set(results["per_seed"]) == {"0",
                                                                     "1"}
  for seed in (0, 1):
    child = json.loads((workdir / f"seed_{seed}" / "mix_rl" /
                        "config.json").read_text())
    assert child["seed"] == seed
    assert (workdir / f"seed_{seed}" / "report.md").exists()
  cell = results["methods"]["mix_rl"]["accuracy"]["add"]
  assert cell["seeds"] == 2 and cell["low"] <= cell["mean"] <= cell["high"]
  assert results["paradigms"] == {"merge": "merge/ties", "mix_rl": "mix_rl"}
  # MOPD from the best merge (the only one): started from its parameters
  child = json.loads((workdir / "seed_1" / "mopd_from_merge" /
                      "config.json").read_text())
  assert child["init"] == str(workdir / "seed_1" / "merge_ties")
  assert "mopd_from_merge" in results["methods"]
  assert "with_experts" in results["per_seed"]["0"]["methods"][
      "mopd_from_merge"]["cost"]
  diff = results["differences"]["merge/ties - mix_rl"]
  assert diff["mean"]["seeds"] == 2 and diff["mean"]["prompts"] == 8
  assert set(diff["pass@k"]) == {f"{k}/{d}" for k in (1, 2) for d in
                                 results["domains"]}
  text = (workdir / "report.md").read_text()
  assert "# Fusion study over seeds" in text and "## Paired differences" in text
  assert "Over 2 seed(s) x 8 test prompts" in text
  assert not (workdir / "base").exists()


def test_the_beyond_variants_on_the_smoke_studys_experts(study, data_dir,
                                                        cached_env,
                                                        smoke_run):
  """``:smoke_beyond``'s steps, two of its token routers (the one with
  teacher entropies, the one with the student's distribution; the delta
  teacher has its own CLI test, the rules their own) on the smoke study's
  base, experts, MOPD run and evaluations (copied in: only the variants
  train): each run's router, its cost counting every teacher it ran, the
  routing matrices (each domain's tokens sum to 1) and the report's
  section on them; and the co-evolved experts (CoPD) merged and
  distilled, each beside plain MOPD in the report."""
  import shutil
  workdir = study[0].parent / "beyond"
  for name in ("mopd", "evaluations"):
    shutil.copytree(study[0] / name, workdir / name)
  assert {"mopd_delta", "mopd_entropy", "mopd_novelty", "mopd_align",
          "mopd_from_merge"} < set(load_config("study", "smoke_beyond").steps)
  assert "mopd_from_merge" in load_config("study", "beyond").steps
  routers = {"mopd_entropy": "entropy", "mopd_align": "expert_align"}
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke_beyond",
                     f"--workdir={workdir}", f"--config.base={smoke_run[0]}",
                     f"--config.experts={study[0]}/expert_{{domain}}",
                     "--config.steps=('mopd',%s,'mopd_reward_refresh',"
                     "'copd','copd_merge','copd_mopd','evaluate','report')"
                     % ",".join(f"'{v}'" for v in routers),
                     # the copied MOPD run's (no async step here)
                     "--config.mesh.cpu_devices=1",
                     f"--config.data_dir={data_dir}", env=cached_env,
                     timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mopd finished before" in result.stdout
  # reward refresh alone under the kl loss trains as plain MOPD: a link
  assert os.readlink(workdir / "mopd_reward_refresh") == "mopd"
  assert "mopd_reward_refresh trains bit-identically" in result.stdout
  results = json.loads((workdir / "results.json").read_text())
  methods, domains = results["methods"], results["domains"]
  for name, router in routers.items():
    config = json.loads((workdir / name / "config.json").read_text())
    assert config["opd"]["router"] == router
    # every expert scored every token (align: and the student): more
    # FLOPs per sampled token than MOPD's one teacher
    assert costs.teacher_models(config) == 4 + (router == "expert_align")
    per_token = {m: methods[m]["cost"]["flops"]
                 / methods[m]["cost"]["tokens_sampled"]
                 for m in ("mopd", name)}
    assert per_token[name] > per_token["mopd"]
    for d in domains:
      assert sum(methods[name]["routing"][d].values()) == pytest.approx(
          1.0), (name, d)
  assert "routing" not in methods["mopd"]
  assert methods["mopd_reward_refresh"]["accuracy"] == (
      methods["mopd"]["accuracy"])
  for kind in ("tokens", "loss"):  # each a share of the whole
    assert sum(methods["mopd"]["shares"][kind].values()) == pytest.approx(1)
  # the co-evolved experts, merged and distilled, beside plain MOPD
  copd = workdir / "copd"
  teachers = json.loads((workdir / "copd_mopd" / "config.json").read_text()
                        )["teachers"]
  assert teachers == ",".join(f"{d}={copd}/expert_{d}" for d in domains)
  merged = json.loads((workdir / "copd_merge" / "config.json").read_text())
  assert merged["merge"]["method"] == "dare_ties"
  assert {"copd_merge", "copd_mopd"} <= set(methods)
  text = (workdir / "report.md").read_text()
  assert "## Beyond plain MOPD" in text and "Routing of mopd_align" in text
  assert "| model | tokens " + domains[0] in text


def test_a_study_on_file_domains(tmp_path, data_dir, cached_env, smoke_run):
  """The study on two of the user's own math files from a given base:
  GRPO experts (in folders named by kind and file), Merge, every model
  evaluated on those domains alone, the report."""
  names = ["math:" + math_file(tmp_path / "sums.jsonl", 400),
           "math:" + math_file(tmp_path / "diffs.jsonl", 400, op="-")]
  workdir = tmp_path / "study"
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke",
                     f"--workdir={workdir}", f"--config.base={smoke_run[0]}",
                     f"--config.domains={tuple(names)!r}",
                     "--config.steps=('experts','merge','evaluate','report')",
                     f"--config.data_dir={data_dir}", env=cached_env,
                     timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((workdir / "results.json").read_text())
  assert results["domains"] == names and results["held_out"] == []
  assert set(results["methods"]) == {"base", f"expert/{names[0]}",
                                     f"expert/{names[1]}", "merge/ties",
                                     "oracle"}
  for entry in results["methods"].values():
    assert set(entry["accuracy"]) == set(names)
  assert (workdir / "expert_math_sums" / "summary.json").exists()
  assert (workdir / "expert_math_diffs" / "summary.json").exists()
  assert "## Recommendation" in (workdir / "report.md").read_text()
  assert sorted(p.name for p in (workdir / "evaluations").iterdir()) == [
      f"{m}_eval_8.json" for m in ("base", "expert_math_diffs",
                                   "expert_math_sums", "merge_ties")]


def test_children_run_on_the_studys_mesh(tmp_path):
  """The study's mesh section is every child run's; a child's own
  override still wins."""
  config = load_config("study", "smoke")
  config.mesh.update(cpu_devices=2, fsdp=2, rules="fsdp")
  config.overrides.mopd = ("mesh.rules=dp",)
  study = study_stage.Study(stages.validate(config), str(tmp_path))
  for name, rules in (("mix_rl", "fsdp"), ("mopd", "dp")):
    fields = {"teachers": study.template} if name == "mopd" else {}
    mesh = study.child_config(name, init=study.base, **fields).mesh
    assert (mesh.cpu_devices, mesh.fsdp, mesh.rules) == (2, 2, rules), name


def test_bad_step_and_missing_base_are_one_line(tmp_path):
  result = train_cli(f"--config={ROOT}/configs/study.py:smoke",
                     f"--workdir={tmp_path / 'w'}",
                     "--config.steps=('base','distil')")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      "error: steps: unknown step 'distil'; known: "
      + ", ".join(study_stage.STEPS))
  assert "mopd_trb" in study_stage.STEPS

  def refused(**fields):
    """The study's checks of its runs and domains, in process (the line
    above is the command line's)."""
    config = load_config("study", "smoke")
    config.update(fields)
    with pytest.raises(ConfigError) as e:
      study_stage.check(stages.validate(config))
    return str(e.value)

  assert refused(base=str(tmp_path / "none")).startswith("base:")
  assert refused(domains=(f"math:{tmp_path}/m.jsonl",)).startswith(
      "base: a study of real models or your own domains starts")
  assert refused(base=".", domains=("math:a/x.jsonl", "math:b/x.jsonl")) == (
      "domains: two domains would share the folder expert_math_x;"
      " give each file its own name")
  assert not (tmp_path / "w").exists()


def test_standard_error_recovery_retention_transfer_by_hand():
  assert report.standard_error(0.5, 100) == pytest.approx(0.05)
  assert report.standard_error(0.0, 100) == 0.0
  # add: (0.6 - 0.4) / (0.8 - 0.4) = 0.5; chain: oracle below base -> None
  got = report.recovery({"add": 0.6, "chain": 0.5}, {"add": 0.4,
                                                     "chain": 0.5},
                        {"add": 0.8, "chain": 0.45}, ["add", "chain"])
  assert got == {"add": pytest.approx(0.5), "chain": None,
                 "mean": pytest.approx(0.5)}
  assert report.recovery({"a": 0.1}, {"a": 0.2}, {"a": 0.2}, ["a"]) == {
      "a": None, "mean": None}
  assert report.retention({"reverse": 0.7, "add": 0.9}, {"reverse": 0.95},
                          ["reverse"]) == {"reverse": pytest.approx(-0.25)}
  t = report.transfer({"add": {"add": 0.9, "sort": 0.1}},
                      {"add": 0.5, "sort": 0.4}, ["add", "sort"])
  assert t == {"add": {"add": pytest.approx(0.4),
                       "sort": pytest.approx(-0.3)}}
  assert report.pass_at_k_of({"eval/pass@2/add": 0.5, "eval/pass@1/add":
                              0.25, "eval/greedy/add/accuracy": 1.0}) == {
                                  "add": {1: 0.25, 2: 0.5}}
  assert math.isclose(report.mean_over({"a": 0.2, "b": 0.4}, ["a", "b"]),
                      0.3)


def test_recommendation_names_the_best_of_each_paradigm():
  def entry(add, sort, flops):
    return dict(accuracy={"add": add, "sort": sort},
                cost={"flops": flops, "with_experts": {"flops": flops}})
  results = dict(domains=["add", "sort"], methods={
      "merge/ties": entry(0.6, 0.5, 10.0),
      "merge/task_arithmetic": entry(0.5, 0.5, 10.0),
      "mix_rl": entry(0.7, 0.3, 50.0), "mopd": entry(0.8, 0.6, 100.0)})
  rec = report.recommendation(results)
  assert rec["best"]["merge"]["model"] == "merge/ties"
  assert rec["winners"] == {"add": "mopd", "sort": "mopd"}
  assert "mopd (mopd, 70.0%)" in rec["text"]
  assert "Merge costs 0.10x MOPD's compute" in rec["text"]
  assert "MOPD is best or tied on 2 of 2 domains" in rec["text"]
  # With standard errors of 0.02 a gap of 0.05 is a tie (2 sqrt(2) 0.02 =
  # 0.057), one of 0.1 is not.
  for m in results["methods"].values():
    m["stderr"] = {"add": 0.02, "sort": 0.02}
  results["methods"]["mix_rl"]["accuracy"]["add"] = 0.85
  results["methods"]["mopd"]["accuracy"]["sort"] = 0.38
  rec = report.recommendation(results)
  assert rec["winners"] == {"add": "mix_rl", "sort": "merge"}
  assert rec["tied"] == {"add": ["mix_rl", "mopd"], "sort": ["merge"]}
  assert "add: mix_rl = mopd, sort: merge" in rec["text"]
  assert "MOPD is best or tied on 1 of 2 domains (add)" in rec["text"]


def test_eta_is_the_priors_at_this_machines_pace():
  assert study_stage.eta_minutes(["mopd"], []) is None
  # base and one expert took 2x their prior here: the rest will too
  ran = [("base", 2 * 60 * study_stage.MINUTES["base"]),
         ("experts", 2 * 60 * study_stage.MINUTES["experts"])]
  left = ["experts", "merge", "evaluate"]
  assert study_stage.eta_minutes(left, ran) == pytest.approx(
      2 * sum(study_stage.MINUTES[k] for k in left))


@pytest.mark.parametrize("override,words", [
    ("nonsense=1", "overrides.mix_rl: nonsense: unknown field"),
    ("a.b=1", "overrides.mix_rl: a.b: unknown field"),
    ("train.steps=[1,2]", r"overrides.mix_rl: train.steps: \(1, 2\) does"),
    ("train=5", "overrides.mix_rl: train: a section, not a value"),
])
def test_every_step_config_is_checked_before_anything_runs(tmp_path,
                                                           override, words):
  config = load_config("study", "smoke")
  config.overrides.mix_rl = (override,)
  with pytest.raises(ConfigError, match=words):
    stages.run(stages.validate(config), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_plugged_in_runs_must_be_runs_with_checkpoints(tmp_path):
  config = load_config("study", "smoke")
  config.base = str(tmp_path)
  with pytest.raises(CheckpointError, match="not a mopd_jax run directory"):
    stages.run(stages.validate(config), str(tmp_path / "w"))
  (tmp_path / "config.json").write_text('{"model": {}}')
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    stages.run(stages.validate(config), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_a_study_rerun_with_other_settings_is_refused(tmp_path):
  """The whole config, overrides included, against the saved one; the
  steps to run may change."""
  config = stages.validate(load_config("study", "smoke"))
  runs.save_run_config(config, str(tmp_path))
  again = stages.validate(load_config("study", "smoke"))
  again.steps = ("evaluate", "report")
  runs.check_resumable(again, str(tmp_path))  # fine
  again.seed = 7
  again.overrides.mix_rl = ("train.steps=800",)
  with pytest.raises(CheckpointError, match=r"configured otherwise: "
                     r"overrides.mix_rl .* seed \(0 -> 7\)"):
    runs.check_resumable(again, str(tmp_path))


def test_seeds_one_at_a_time_each_a_one_seed_study(tmp_path):
  """Sequential seeds: the base once (its own seed), then one task per
  seed, whose sub-study has no base step and every step's seed set; a bad
  override of any seed's step is refused before anything runs."""
  config = load_config("study", "smoke_seeds")
  assert config.seeds == (0, 1) and config.seed_processes == 1
  study = study_stage.Study(stages.validate(config), str(tmp_path))
  tasks = study_stage._tasks(study)
  assert [t[1] for t in tasks] == ["base", "seed 0", "seed 1",
                                   "report over seeds"]
  sub = study_stage.seed_config(study.config, 1, str(tmp_path))
  assert sub.seeds == () and "base" not in sub.steps
  assert sub.base == str(tmp_path / "base")
  child = study_stage.Study(sub, str(tmp_path / "seed_1")).child_config(
      "grpo", domain="add", init=sub.base)
  assert child.seed == 1
  config.overrides.mopd = ("nonsense=1",)
  with pytest.raises(ConfigError, match="overrides.mopd: nonsense"):
    stages.run(stages.validate(config), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
  config = load_config("study", "seeds")
  assert config.seeds == (0, 1, 2) and config.seed_processes == 2


def test_mopd_from_merge_starts_from_the_best_validated_merge(tmp_path):
  """The merge with the highest validation score is the init (a merge
  without one, or unfinished, is passed over); the recommendation sets
  the result beside plain MOPD with its compute ratio."""
  config = load_config("study", "smoke")
  config.merge_methods = ("ties", "karcher", "linear")
  config.steps = ("merge", "mopd_from_merge", "evaluate", "report")
  study = study_stage.Study(stages.validate(config), str(tmp_path))
  with pytest.raises(ConfigError, match="mopd_from_merge needs a finished"):
    study.best_merge()
  for method, score in (("ties", 0.4), ("karcher", 0.6), ("linear", None)):
    run = tmp_path / f"merge_{method}"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"validation_greedy_mean": score}))
  assert study.best_merge() == str(tmp_path / "merge_karcher")
  # A merge written before the score was recorded: its sweep's chosen point
  (tmp_path / "merge_linear" / "sweep.json").write_text(json.dumps(
      {"best": {"lam": 1.0}, "grid": [{"lam": 0.5, "mean": 0.9},
                                      {"lam": 1.0, "mean": 0.7}]}))
  (tmp_path / "merge_linear" / "summary.json").write_text("{}")
  assert study.best_merge() == str(tmp_path / "merge_linear")
  assert [t[1] for t in study_stage._tasks(study)][3] == (
      "MOPD from the best merge")

  def entry(acc, flops):
    return dict(accuracy={"a": acc}, stderr={"a": 0.01},
                cost={"flops": flops, "with_experts": {"flops": flops}})
  text = report.recommendation(dict(domains=["a"], methods={
      "mopd": entry(0.5, 10.0), "mopd_from_merge": entry(0.6, 12.0)}))[
          "text"]
  assert ("MOPD from the best merge: 60.0% mean against plain MOPD's 50.0%"
          " at the same MOPD steps, at 1.20x its compute") in text
  config.merge_methods = ()
  with pytest.raises(ConfigError, match="merge_methods, which is empty"):
    stages.run(stages.validate(config), str(tmp_path / "w"))


@pytest.mark.parametrize("variant", ["smoke_beyond", "smoke_variants",
                                     "beyond", "variants"])
def test_every_added_mopd_variant_is_a_valid_step(variant):
  """Each step a study variant adds is a row of ``MOPD_VARIANTS`` whose
  ``configs/mopd.py`` fields validate (the study's own check builds every
  step's config before anything runs)."""
  config = stages.validate(load_config("study", variant))
  added = [s for s in config.steps if s.startswith("mopd_")]
  assert len(added) >= 5 and set(added) <= set(study_stage.MOPD_VARIANTS)
  study_stage.check(config)


def test_the_async_row_needs_a_device_for_its_sampler(monkeypatch):
  """``mopd_async`` is one-step-async MOPD (lag 1, truncated weights);
  ``:beyond`` splits a CPU into two devices for it, and a study with the
  step on a one-device host is refused before anything runs."""
  config = stages.validate(load_config("study", "beyond"))
  assert "mopd_async" in config.steps and config.mesh.cpu_devices == 2
  study = study_stage.Study(config, "<workdir>")
  child = study.child_config("mopd", init=study.base, teachers=study.template,
                             **study_stage.MOPD_VARIANTS["mopd_async"]())
  assert (child.rl.max_policy_lag, child.rl.tis_cap) == (1, 2.0)
  assert stages.validate(load_config("study")).mesh.cpu_devices == 1
  monkeypatch.setattr(jax, "device_count", lambda: 1)
  with pytest.raises(ConfigError, match="mopd_async samples on a device"):
    study_stage.check(config)


@pytest.mark.parametrize("variant", ["smoke_imbalanced", "imbalanced"])
def test_the_imbalanced_study_has_the_papers_conditions(variant):
  """``:imbalanced``: ``derive`` (long) and ``instruct`` (concise) only,
  the base trained on them and the held-out domain, every step's config
  valid; MOPD with two epochs over four minibatches (stale rollouts);
  plain MOPD, each Open-MOPD mechanism alone and all three."""
  config = stages.validate(load_config("study", variant))
  study_stage.check(config)
  study = study_stage.Study(config, "<workdir>")
  assert study.domains == ("derive", "instruct")
  assert study.eval_domains == ("derive", "instruct", "reverse")
  base = study.child_config("pretrain")
  assert base.data.domains == ("derive", "instruct", "reverse")
  mopd = study.child_config("mopd", init="b", teachers=study.template)
  # every model's layers as a loop (the variant's budget)
  assert not base.model.scan_layers and not mopd.model.scan_layers
  assert mopd.rl.epochs == 2 and mopd.rl.minibatches == (
      2 if variant.startswith("smoke") else 4)
  # the full size's updates in parts by length (the same steps, less
  # padding); its experts' too
  expert = study.child_config("grpo", init="b", domain="derive")
  assert (mopd.rl.length_buckets, expert.rl.length_buckets) == (
      (1, 1) if variant.startswith("smoke") else (4, 4))
  assert mopd.data.domains == ("derive", "instruct")
  assert config.steps == ("base", "experts", "mopd", "open_mopd",
                          "mopd_token_share", "mopd_gap_budget",
                          "mopd_reward_refresh", "evaluate", "report")
  alone = study_stage.MOPD_VARIANTS["mopd_gap_budget"]()
  assert alone == {"open_mopd.gap_budget": True,
                   "open_mopd.gap_statistic": "sequence_kl"}


def test_a_report_rerun_keeps_the_mopd_variants_that_ran(tmp_path):
  """``--config.steps="('report',)"`` after a ``:beyond`` study: a variant
  whose run is in the workdir stays in the comparison; one never run is
  not in it."""
  config = stages.validate(load_config("study", "smoke"))
  config.steps = ("report",)
  (tmp_path / "mopd_delta").mkdir()
  (tmp_path / "mopd_delta" / "config.json").write_text("{}")
  models = study_stage.Study(config, str(tmp_path)).models()
  assert "mopd_delta" in models and "mopd_trb" not in models
