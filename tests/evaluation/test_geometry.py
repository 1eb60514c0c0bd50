"""Task-vector geometry against constructed task vectors with known answers."""

import numpy as np
import pytest

from mopd_jax.evaluation import geometry

DOMAINS = ("a", "b", "c", "d")


def _geometry(taus: dict, tolerance=0.0):
  """Geometry of experts ``base + taus[name][i]`` over a zero base."""
  base = {name: np.zeros_like(v[0]) for name, v in taus.items()}
  return geometry.task_vector_geometry(
      list(taus), base.__getitem__,
      lambda name: [base[name] + t for t in taus[name]], DOMAINS,
      embed_dim=4, stacked=lambda n: n.startswith("layers/"),
      tolerance=tolerance, rank=1)


def test_identical_orthogonal_opposite_and_disjoint_task_vectors():
  v = np.array([1.0, 2.0, 0.0, 0.0])
  taus = {"embed": [v, 3 * v, np.array([0.0, 0.0, 5.0, 1.0]), -v]}
  g = _geometry(taus)
  assert g["cosine"]["a"]["b"] == pytest.approx(1.0)  # identical direction
  assert g["cosine"]["a"]["c"] == pytest.approx(0.0)  # orthogonal
  assert g["cosine"]["a"]["d"] == pytest.approx(-1.0)  # opposite
  assert g["sparsity"]["a"] == 0.5 and g["sparsity"]["c"] == 0.5
  # a and c change disjoint entries; a and d the same two, both opposite
  assert g["support_overlap"]["a"]["c"] == 0.0
  assert g["support_overlap"]["a"]["d"] == 1.0
  assert g["sign_conflict"]["a"]["d"] == 1.0
  assert g["sign_conflict"]["a"]["b"] == 0.0
  assert g["norm"]["b"] == pytest.approx(3 * np.sqrt(5))
  assert g["cosine_per_kind"]["embeddings"]["a"]["d"] == pytest.approx(-1)


def test_tolerance_sets_what_counts_as_changed():
  taus = {"embed": [np.array([1.0, 0.01, 0.0, 0.0])] * 4}
  assert _geometry(taus)["sparsity"]["a"] == 0.5
  assert _geometry(taus, tolerance=0.1)["sparsity"]["a"] == 0.25


def test_per_layer_cosine_and_subspace_overlap():
  """Two layers: the experts agree on layer 0 and are orthogonal on layer
  1, both in direction and in their rank-1 column spaces."""
  e0, e1 = np.eye(4)[0], np.eye(4)[1]
  same = np.outer(e0, [1.0, 2.0])  # [embed 4, 2]
  other = np.outer(e1, [1.0, 2.0])
  taus = {"layers/up": [np.stack([same, same]), np.stack([same, other]),
                        np.stack([same, same]), np.stack([same, same])]}
  g = _geometry(taus)
  assert g["cosine_per_layer"]["0"]["a"]["b"] == pytest.approx(1.0)
  assert g["cosine_per_layer"]["1"]["a"]["b"] == pytest.approx(0.0)
  sub = g["subspace_overlap_per_layer"]
  assert sub["0"]["a"]["b"] == pytest.approx(1.0)
  assert sub["1"]["a"]["b"] == pytest.approx(0.0, abs=1e-12)
  assert g["cosine"]["a"]["b"] == pytest.approx(0.5)  # half the norm agrees


def test_figures_are_png():
  taus = {"layers/up": [np.ones((2, 4, 2)) * (i + 1) for i in range(4)]}
  for data in geometry.figures(_geometry(taus)).values():
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_top_subspace_is_the_svd_subspace():
  """The eigenvectors of ``a a^T`` span the top left singular vectors of
  numpy's SVD (the same projection), for wide and tall updates."""
  rng = np.random.default_rng(0)
  for shape in ((12, 30), (12, 5)):
    a = rng.normal(size=shape)
    u = geometry.top_subspace(a, 4)
    want = np.linalg.svd(a, full_matrices=False)[0][:, :4]
    np.testing.assert_allclose(u @ u.T, want @ want.T, atol=1e-10)
    assert geometry.subspace_overlap(u, want) == pytest.approx(1.0)
