"""The seeded study's comparison on outcomes built to have a known answer:
MOPD right on every ``a`` prompt where Mix RL and the merge are wrong;
every paradigm identical on ``b``."""

import numpy as np
import pytest

from mopd_jax.evaluation import headroom, intervals, report, seeded

DOMAINS = ["a", "b"]
N = 40


def _outcomes(seed):
  rng = np.random.default_rng(seed)
  shared_b = (rng.random(N) < 0.5).astype(int)
  noise = (rng.random(N) < 0.2).astype(int)
  per_model = {
      "base": {"a": np.zeros(N, int), "b": shared_b},
      "expert/a": {"a": np.ones(N, int), "b": shared_b},
      "expert/b": {"a": np.zeros(N, int), "b": shared_b},
      "merge/ties": {"a": noise, "b": shared_b},
      "mix_rl": {"a": noise, "b": shared_b},
      "mopd": {"a": np.ones(N, int), "b": shared_b},
  }
  return {m: {f"greedy/{d}": v.tolist() for d, v in o.items()}
          for m, o in per_model.items()}


def _results(outcomes):
  scalars = {m: {f"eval/{mode}/{key.split('/')[1]}/accuracy": float(
      np.mean(v)) for key, v in o.items() for mode in report.MODES}
             for m, o in outcomes.items()}
  for s in scalars.values():
    s.update({f"eval/pass@{k}/{d}": 0.1 * k for d in DOMAINS for k in (1, 2)})
  base = {mode: headroom.accuracies(scalars["base"], mode)
          for mode in report.MODES}
  oracle = {mode: {d: headroom.accuracies(scalars[f"expert/{d}"], mode)[d]
                   for d in DOMAINS} for mode in report.MODES}
  methods = {m: report.model_entry(s, base, oracle, DOMAINS, [], N)
             for m, s in scalars.items()}
  return dict(domains=DOMAINS, held_out=[], methods=methods,
              eval=dict(num_prompts=N, samples=2))


def _coverage(outcomes):
  return {m: dict(samples=2, counts={d: (2 * np.array(o[f"greedy/{d}"])
                                         ).tolist() for d in DOMAINS})
          for m, o in outcomes.items()}


@pytest.fixture(scope="module")
def aggregated():
  seeds = [0, 1, 2]
  outcomes = [_outcomes(s) for s in seeds]
  return seeded.aggregate(seeds, [_results(o) for o in outcomes], outcomes,
                          [_coverage(o) for o in outcomes])


def test_cells_are_means_over_seeds_with_t_intervals(aggregated):
  per = [float(np.mean(_outcomes(s)["mix_rl"]["greedy/a"])) for s in range(3)]
  cell = aggregated["methods"]["mix_rl"]["accuracy"]["a"]
  assert cell == pytest.approx(intervals.seed_interval(per))
  assert aggregated["methods"]["mopd"]["accuracy"]["a"]["mean"] == 1.0
  assert aggregated["methods"]["mopd"]["headroom_recovery"]["a"][
      "mean"] == pytest.approx(1.0)
  assert aggregated["methods"]["base"]["pass_at_k"]["a"][2][
      "mean"] == pytest.approx(0.2)


def test_winner_only_where_the_difference_excludes_zero(aggregated):
  rec = aggregated["recommendation"]
  assert aggregated["paradigms"] == {"merge": "merge/ties",
                                     "mix_rl": "mix_rl", "mopd": "mopd"}
  assert rec["winners"]["a"] == "mopd"
  assert rec["winners"]["b"] is None
  assert set(rec["tied"]["b"]) == {"merge", "mix_rl", "mopd"}
  diff = aggregated["differences"]["merge/ties - mopd"]
  assert diff["b"]["mean"] == diff["b"]["low"] == diff["b"]["high"] == 0.0
  assert diff["a"]["high"] < 0
  # merge and Mix RL have equal outcomes: tied on both domains
  assert aggregated["differences"]["merge/ties - mix_rl"]["mean"][
      "mean"] == 0.0
  assert "3 seed(s) x 40 test prompts" in rec["text"]
  assert "b: tied" in rec["text"] and "a: mopd" in rec["text"]


def test_pass_at_k_differences_and_report(aggregated):
  diff = aggregated["differences"]["mix_rl - mopd"]["pass@k"]
  assert set(diff) == {"1/a", "1/b", "2/a", "2/b"}
  assert diff["2/b"]["mean"] == 0.0 and diff["1/a"]["high"] < 0
  text = seeded.markdown(aggregated)
  assert "| mopd | 100.0 [100.0, 100.0]" in text
  assert "## Paired differences" in text and "## Coverage" in text
  assert seeded.coverage_figure(aggregated)[:4] == b"\x89PNG"


def test_one_seed_has_no_intervals_and_names_no_false_winner():
  outcomes = [_outcomes(0)]
  out = seeded.aggregate([0], [_results(outcomes[0])], outcomes,
                         [_coverage(outcomes[0])])
  assert out["methods"]["mopd"]["accuracy"]["a"]["low"] is None
  # one seed: the prompt-level bootstrap still separates a, ties b
  assert out["recommendation"]["winners"]["a"] == "mopd"
  assert out["recommendation"]["winners"]["b"] is None


def test_a_study_of_mopd_variants_alone_ranks_no_paradigm():
  """With MOPD the only paradigm (a study of its variants), neither report
  names a paradigm ahead of the others; each variant is set against
  MOPD."""
  def variants(o):
    return {m: v for m, v in o.items() if m not in ("merge/ties", "mix_rl")}
  outcomes = [variants(_outcomes(s)) for s in (0, 1)]
  for o in outcomes:
    o["mopd_async"] = o["expert/b"]
  out = seeded.aggregate([0, 1], [_results(o) for o in outcomes], outcomes,
                         [_coverage(o) for o in outcomes])
  text = out["recommendation"]["text"]
  assert "Training-domain mean (greedy): mopd (mopd)" in text
  assert "ahead of" not in text and "tied" not in text
  assert "mopd_async minus MOPD on the mean: -50.0" in text
  one = report.recommendation(out["per_seed"]["0"])["text"]
  assert "Highest training-domain mean (greedy): mopd" in one
  assert "differ by" not in one and "best or tied" not in one


def test_loss_shares_are_step_means_then_seed_intervals(tmp_path):
  """``study_report.loss_shares``: the mean over logged steps of each
  domain's token and loss shares (steps that log none are skipped; a run
  without loss shares, RL, has none); over
  seeds, the Student-t cell of each, in the seeded report's table."""
  import json
  from mopd_jax.evaluation import study_report
  steps = [{"step": 1, "share/tokens/a": 0.9, "share/tokens/b": 0.1,
            "share/loss/a": 0.5, "share/loss/b": 0.5},
           {"step": 2, "eval/greedy/a/accuracy": 0.3},
           {"step": 3, "share/tokens/a": 0.98, "share/tokens/b": 0.02,
            "share/loss/a": 0.7, "share/loss/b": 0.3}]
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in steps))
  shares = study_report.loss_shares(str(tmp_path), DOMAINS)
  assert shares["tokens"] == pytest.approx({"a": 0.94, "b": 0.06})
  assert shares["loss"] == pytest.approx({"a": 0.6, "b": 0.4})
  assert study_report.loss_shares(str(tmp_path / "none"), DOMAINS) is None
  rl = tmp_path / "rl"  # an RL run logs token shares, no loss shares
  rl.mkdir()
  (rl / "metrics.jsonl").write_text(json.dumps(
      {"step": 1, "share/tokens/a": 0.5, "share/tokens/b": 0.5}) + "\n")
  assert study_report.loss_shares(str(rl), DOMAINS) is None
  seeds = [0, 1, 2]
  outcomes = [_outcomes(s) for s in seeds]
  per_seed = [_results(o) for o in outcomes]
  for k, r in enumerate(per_seed):
    r["methods"]["mopd"]["shares"] = {
        "tokens": {"a": 0.9 + 0.01 * k, "b": 0.1 - 0.01 * k},
        "loss": {"a": 0.5, "b": 0.5}}
  out = seeded.aggregate(seeds, per_seed, outcomes,
                         [_coverage(o) for o in outcomes])
  cell = out["methods"]["mopd"]["shares"]["tokens"]["b"]
  assert cell == pytest.approx(intervals.seed_interval([0.1, 0.09, 0.08],
                                                       bounds=(0.0, 1.0)))
  assert "shares" not in out["methods"]["mix_rl"]
  text = seeded.markdown(out)
  assert "## Loss shares" in text
  assert "| mopd | 91.0 [" in text and "| mix_rl |" not in text.split(
      "## Loss shares")[1]
