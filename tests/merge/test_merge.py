"""Merge methods against values computed by hand on tiny arrays."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import stages
from mopd_jax.errors import ConfigError
from mopd_jax.merge import methods, parameters, tree
from mopd_jax.stages.merge import sweep_grid


def _run(method, b, taus, **settings):
  b = jnp.asarray(b, jnp.float32)
  x = b[None] + jnp.asarray(taus, jnp.float32)
  s = parameters.Settings(method=method, weights=settings.pop(
      "weights", (1.0,) * len(taus)), **settings)
  return np.asarray(methods.METHODS[method].fn(b, x, s, jax.random.key(0)))


B = [1.0, 1.0, 1.0, 1.0]


def test_task_arithmetic_is_base_plus_lambda_weighted_sum():
  out = _run("task_arithmetic", B, [[1, -2, 0, 4], [3, 2, 1, 0]],
             weights=(1.0, 0.5), lam=0.5)
  np.testing.assert_allclose(out, [1 + 0.5 * 2.5, 1 + 0.5 * -1,
                                   1 + 0.5 * 0.5, 1 + 0.5 * 4])


def test_linear_is_the_weighted_average_of_the_experts():
  out = _run("linear", B, [[1, 0, 0, 0], [0, 0, 0, 3]], weights=(3.0, 1.0))
  np.testing.assert_allclose(out, [1.75, 1, 1, 1.75])


def test_ties_trims_elects_signs_and_takes_the_disjoint_mean():
  # density 0.5 keeps two entries each: [0, -2, 3, 0] and [-1.5, -1, 0, 0];
  # sum [-1.5, -3, 3, 0] elects signs [-, -, +, +]; entries that agree:
  # means [-1.5, (-2 - 1) / 2, 3, none -> 0].
  out = _run("ties", B, [[1, -2, 3, 0.5], [-1.5, -1, 0.8, 0.2]],
             density=0.5)
  np.testing.assert_allclose(out, np.add(B, [-1.5, -1.5, 3, 0]))
  # normalize off: the agreeing entries are summed, not averaged
  out = _run("ties", B, [[1, -2, 3, 0.5], [-1.5, -1, 0.8, 0.2]],
             density=0.5, normalize=False)
  np.testing.assert_allclose(out, np.add(B, [-1.5, -3, 3, 0]))


def test_sign_consensus_counts_weighted_sums_and_zero_never_agrees():
  weighted = jnp.array([[2.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
  np.testing.assert_array_equal(methods.sign_consensus(weighted),
                                [[True, True, False], [False, True, False]])


def test_dare_keeps_each_entry_with_probability_density_and_rescales():
  tau = np.linspace(1.0, 2.0, 4000).reshape(2, 2000)
  out = _run("dare_linear", np.zeros(2000), [tau[0], tau[1]],
             density=0.25)
  kept = [np.asarray(jax.random.bernoulli(
      jax.random.fold_in(jax.random.key(0), d), 0.25, (2000,)))
          for d in range(2)]
  np.testing.assert_allclose(out, (tau[0] * kept[0] + tau[1] * kept[1])
                             / 0.25, rtol=1e-6)
  for k in kept:  # 500 expected, sd 19.4
    assert 440 < k.sum() < 560
  without = _run("dare_linear", np.zeros(2000), [tau[0], tau[1]],
                 density=0.25, rescale=False)
  np.testing.assert_allclose(without, out * 0.25, rtol=1e-6)


def test_breadcrumbs_keeps_the_band_between_the_outliers_and_the_small():
  tau = jnp.arange(1.0, 11.0)[::-1]  # 10, 9, ..., 1
  # density 0.5, gamma 0.1: drop the top 1 (10) and the bottom 4 (1-4)
  np.testing.assert_array_equal(np.asarray(methods.band_mask(tau, 0.5, 0.1)),
                                np.isin(np.asarray(tau), [5, 6, 7, 8, 9]))
  # density 0.95: n_bot would be -0.5 -> 0; 9 kept, only the top one dropped
  np.testing.assert_array_equal(np.asarray(methods.band_mask(tau, 0.95, 0.1)),
                                np.asarray(tau) != 10)
  assert bool(methods.band_mask(tau, 1.0, 0.1).all())


def test_magnitude_mask_keeps_floor_density_n_largest_at_least_one():
  tau = jnp.array([0.1, -5.0, 3.0, -0.2, 1.0])
  np.testing.assert_array_equal(np.asarray(methods.magnitude_mask(tau, 0.5)),
                                [False, True, True, False, False])
  np.testing.assert_array_equal(np.asarray(methods.magnitude_mask(tau, 0.1)),
                                [False, True, False, False, False])


def test_model_stock_interpolation_factor():
  # Orthogonal task vectors: cos 0, t 0, the base.
  np.testing.assert_allclose(_run("model_stock", [1.0, 1.0],
                                  [[1, 0], [0, 1]]), [1.0, 1.0], atol=1e-7)
  # cos = 1/sqrt(2), N = 2: t = 2c / (1 + c)
  c = 1 / np.sqrt(2)
  t = 2 * c / (1 + c)
  avg = np.array([1.0, 0.5])
  np.testing.assert_allclose(_run("model_stock", [0.0, 0.0],
                                  [[1, 0], [1, 1]]), t * avg, rtol=1e-6)


def test_slerp_ends_middle_and_parallel_vectors():
  orth = [[1.0, 0.0], [0.0, 1.0]]
  zero = [0.0, 0.0]
  np.testing.assert_allclose(_run("slerp", zero, orth, t=0.0), [1, 0],
                             atol=1e-7)
  np.testing.assert_allclose(_run("slerp", zero, orth, t=1.0), [0, 1],
                             atol=1e-7)
  np.testing.assert_allclose(_run("slerp", zero, orth, t=0.5),
                             [np.sin(np.pi / 4)] * 2, rtol=1e-6)
  # parallel: the straight line, which keeps the norms' interpolation
  np.testing.assert_allclose(_run("slerp", zero, [[1, 2], [2, 4]], t=0.25),
                             [1.25, 2.5], rtol=1e-6)


def test_karcher_mean_of_orthogonal_vectors():
  out = _run("karcher", [0.0, 0.0], [[2.0, 0.0], [0.0, 2.0]])
  np.testing.assert_allclose(out, [np.sqrt(2)] * 2, rtol=1e-5)
  # one expert: itself
  np.testing.assert_allclose(_run("karcher", [0.0, 0.0], [[3.0, 4.0]]),
                             [3.0, 4.0], rtol=1e-6)


def test_sparse_union_takes_single_changes_and_means_shared_ones():
  out = _run("sparse_union", B, [[1, 0, 2, 0.01], [0, 0, 4, 0.0]],
             tolerance=0.05)
  np.testing.assert_allclose(out, np.add(B, [1, 0, 3, 0]))


def test_overrides_first_match_wins_and_ramps_over_layers():
  rules = parameters.parse_overrides("layers/(q|k):density=0.5,lambda=0.2..1.0;"
                                "layers/:density=0.9")
  base = parameters.Settings("ties", (1.0,), density=0.3)
  q = parameters.leaf_settings("layers/q", 3, base, rules)
  assert q["density"] == 0.5
  np.testing.assert_allclose(q["lam"], [0.2, 0.6, 1.0])
  assert parameters.leaf_settings("layers/up", 3, base, rules)["density"] == 0.9
  assert parameters.leaf_settings("embed", None, base, rules)["density"] == 0.3
  with pytest.raises(ConfigError, match="needs stacked layers"):
    parameters.leaf_settings("embed", None, base,
                        parameters.parse_overrides("embed:lambda=0..1"))


@pytest.mark.parametrize("spec, match", [
    ("attn:alpha=1", "key must be one of"),
    ("attn:density=x", "not a number"),
    ("density=1", "not pattern:key=value"),
    ("(:density=0.5", "bad pattern"),
    ("attn:density=1.5", r"density=1.5 must be in \(0, 1\]"),
    ("layers/:t=0..2", r"t=2.0 must be in \[0, 1\]"),
    ("embed:lambda=nan", "lambda=nan must be a finite number"),
])
def test_bad_overrides_are_one_config_error(spec, match):
  with pytest.raises(ConfigError, match=match):
    parameters.parse_overrides(spec)


def test_parameters_are_declared_once():
  """The config's defaults and checks and the Settings' defaults are the
  table's."""
  section = stages.defaults("merge").merge
  settings = parameters.Settings("ties", (1.0,))
  for name, p in parameters.PARAMETERS.items():
    assert section[name] == p.default
    assert getattr(settings, "lam" if name == "lambda" else name) == p.default
  bad = stages.defaults("merge")
  bad.update(init="runs/base", experts="runs/a,runs/b")
  bad.merge.gamma = 1.0
  with pytest.raises(ConfigError, match=r"merge.gamma.*in \[0, 1\)"):
    stages.validate(bad)
  # a ramp's per-layer values are checked value by value
  parameters.check_settings(dict(density=np.array([0.2, 0.5]), gamma=0.0,
                            lam=1.0, t=0.5, tolerance=0.0), "layers/q")


def test_density_out_of_range_names_the_leaf():
  with pytest.raises(ConfigError, match=r"merge.density: .* for layers/q"):
    parameters.check_settings(dict(density=1.5, gamma=0.0, lam=1.0, t=0.5,
                              tolerance=0.0),
                         "layers/q")


def test_stacked_leaves_merge_layer_by_layer_with_per_layer_lambda():
  # Layer 0 has the large entries: a whole-leaf top-2 would keep only them.
  b = jnp.zeros((2, 4))
  tau = jnp.array([[[9.0, 8.0, 0.1, 0.2], [0.3, 0.1, 0.2, 0.4]]])
  settings = parameters.Settings("ties", (1.0,), density=0.5)
  rules = parameters.parse_overrides("w:lambda=1..2")
  out = tree.merge_leaf("w", b, list(tau), settings, rules,
                         jax.random.key(0), stacked=True)
  np.testing.assert_allclose(out, [[9, 8, 0, 0], [2 * 0.3, 0, 0, 2 * 0.4]],
                             rtol=1e-6)


def test_merge_params_walks_every_leaf_and_is_deterministic():
  """The stage merges with merge_params(seed=config.seed): the same command
  gives the same parameters, another seed another DARE draw."""
  key = jax.random.key(1)
  base = {"embed": jax.random.normal(key, (6, 4)),
          "layers": {"q": jax.random.normal(jax.random.fold_in(key, 1),
                                            (2, 4, 3))}}
  experts = [jax.tree.map(lambda p, i=i: p + 0.1 * (i + 1) * jnp.sign(p),
                          base) for i in range(3)]
  settings = parameters.Settings("dare_ties", (1.0, 1.0, 1.0), density=0.5)

  def merged(seed):
    return tree.merge_params(base, tree.in_memory(experts), settings,
                              seed=seed,
                              is_stacked=lambda n: n.startswith("layers/"))

  chex.assert_trees_all_equal(merged(3), merged(3))
  assert not np.array_equal(merged(3)["embed"], merged(4)["embed"])
  chex.assert_trees_all_equal_shapes_and_dtypes(merged(3), base)
  # task arithmetic with weights 1/3 and lambda 1: the experts' mean
  mean = tree.merge_params(
      base, tree.in_memory(experts),
      dataclasses.replace(settings, method="task_arithmetic",
                          weights=(1 / 3,) * 3))
  chex.assert_trees_all_close(
      mean, jax.tree.map(lambda *e: sum(e) / 3, *experts), rtol=1e-6)


def test_expert_counts():
  with pytest.raises(ConfigError, match="slerp takes 2 experts, got 4"):
    methods.check_experts("slerp", 4)
  with pytest.raises(ConfigError, match="model_stock takes at least 2"):
    methods.check_experts("model_stock", 1)
  methods.check_experts("ties", 1)


def test_sweep_grid_covers_only_what_the_method_reads():
  """The sweep's axes follow from the parameters each method declares:
  ties reads lambda and density, sparse_union lambda, karcher neither."""

  def grid(method, lambdas, densities):
    section = dict(sweep_lambdas=lambdas, sweep_densities=densities)
    return sweep_grid(parameters.Settings(method, (1.0,)), section)

  assert grid("ties", (0.5, 1.0), (0.3, 0.7)) == [
      dict(lam=0.5, density=0.3), dict(lam=0.5, density=0.7),
      dict(lam=1.0, density=0.3), dict(lam=1.0, density=0.7)]
  assert grid("sparse_union", (0.5,), (0.3,)) == [dict(lam=0.5)]
  assert grid("karcher", (0.5,), (0.3,)) == []
  assert {m: methods.sweep_axes(m) for m in ("ties", "breadcrumbs",
                                             "task_arithmetic", "slerp")} == {
      "ties": ("lambda", "density"), "breadcrumbs": ("lambda", "density"),
      "task_arithmetic": ("lambda",), "slerp": ()}
