"""Task-vector geometry of experts trained from one base.

With ``tau_d = theta_d - theta_base`` (every parameter, flattened):

* cosine similarity ``<tau_d, tau_e> / (||tau_d|| ||tau_e||)`` over the
  whole model, per layer (the layer's slice of every stacked leaf) and per
  kind of parameter (attention, MLP, embeddings, norms);
* sparsity: the fraction of entries with ``|tau_d| > tolerance`` (changed);
* sign conflict between two experts: among the entries both changed, the
  fraction whose changes have opposite signs;
* support overlap: ``|S_d & S_e| / |S_d | S_e|`` of the changed sets;
* principal-subspace overlap per layer: for each weight matrix of the
  layer (rows in model space), ``||U_d^T U_e||_F^2 / r`` of the top-``r``
  left singular vectors of the two experts' updates, averaged over the
  layer's matrices (1: the same subspace, ~r/D: unrelated).

Accumulated leaf by leaf (float64), so only one leaf per expert is in
memory. ``python -m mopd_jax.evaluation.geometry --init=BASE
--experts='runs/expert_{domain}' --out=DIR`` writes ``geometry.json`` and
the figures alone; the Merge stage writes them with every merge.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable, Mapping, Sequence

import numpy as np
import scipy.linalg
from absl import flags

from mopd_jax import cli, parallel, runs
from mopd_jax.atomic import write_bytes_atomic, write_json_atomic
from mopd_jax.checksum import named_leaves
from mopd_jax.data.domains import TRAIN_DOMAINS
from mopd_jax.evaluation.figures import png_bytes, pyplot
from mopd_jax.runs import runs_by_domain
from mopd_jax.models.config import ModelConfig
from mopd_jax.models import tokenizer as tokenizer_lib

KINDS = {
    "attention": ("q", "k", "v", "o", "q_norm", "k_norm", "q_bias",
                  "k_bias", "v_bias"),
    "mlp": ("gate", "up", "down"),
    "embeddings": ("embed", "unembed"),
    "norms": ("attn_norm", "mlp_norm", "final_norm"),
}
SUBSPACE_RANK = 8
GEOMETRY_FILE = "geometry.json"


def kind_of(name: str) -> str:
  """The kind of the parameter leaf ``name`` (its last path component)."""
  leaf = name.rsplit("/", 1)[-1]
  return next((k for k, names in KINDS.items() if leaf in names), "other")


def _matrix(name: str, tau: np.ndarray, embed_dim: int) -> np.ndarray | None:
  """One layer's update of a weight matrix as [embed_dim, -1] (rows in
  model space), or None for vectors."""
  if tau.ndim < 2:
    return None
  if tau.shape[0] == embed_dim:
    return tau.reshape(embed_dim, -1)
  if tau.shape[-1] == embed_dim:
    return tau.reshape(-1, embed_dim).T
  return None


def top_subspace(a: np.ndarray, rank: int) -> np.ndarray:
  """The top-``r`` left singular vectors of ``a`` [rows, r] (``r =
  min(rank, rows, cols)``), as the top eigenvectors of ``a a^T``, only
  those computed (LAPACK's ``syevx``: 3x faster than every eigenpair of
  a [576, 576] Gram, which was 7x faster than an SVD of the [576, 1536]
  update; the same subspace)."""
  r = min(rank, *a.shape)
  rows = a.shape[0]
  vectors = scipy.linalg.eigh(a @ a.T, subset_by_index=[rows - r, rows - 1],
                              driver="evx")[1]
  return vectors[:, ::-1]


def subspace_overlap(ua: np.ndarray, ub: np.ndarray) -> float:
  """``||U_a^T U_b||_F^2 / r`` of two ``top_subspace``s."""
  return float(np.sum((ua.T @ ub) ** 2) / ua.shape[1])


class _Tally:
  """Gram matrix and support counts of one group of entries: sums over
  entries, so the tally of a group is the sum of its parts'."""

  def __init__(self, n: int):
    self.gram = np.zeros((n, n))
    self.size = 0
    self.changed = np.zeros(n)
    self.both = np.zeros((n, n))
    self.union = np.zeros((n, n))
    self.opposite = np.zeros((n, n))

  @classmethod
  def of(cls, taus: np.ndarray, tolerance: float) -> "_Tally":
    """The tally of ``taus`` ([experts, ...]) alone."""
    flat = taus.reshape(taus.shape[0], -1)
    out = cls(flat.shape[0])
    out.gram = flat @ flat.T
    out.size = flat.shape[1]
    changed = np.abs(flat) > tolerance
    c = changed.astype(np.float64)
    out.changed = c.sum(1)
    out.both = c @ c.T
    out.union = out.changed[:, None] + out.changed[None, :] - out.both
    sign = np.sign(flat) * changed
    out.opposite = (out.both - sign @ sign.T) / 2  # pairs with -1
    return out

  def add(self, other: "_Tally") -> None:
    for key in ("gram", "size", "changed", "both", "union", "opposite"):
      setattr(self, key, getattr(self, key) + getattr(other, key))

  def cosine(self) -> np.ndarray:
    norms = np.sqrt(np.diag(self.gram))
    denom = np.outer(norms, norms)
    return np.where(denom > 0, self.gram / np.where(denom > 0, denom, 1), 0.0)


def task_vector_geometry(names: Sequence[str], base_leaf: Callable,
                         expert_leaves: Callable, domains: Sequence[str],
                         embed_dim: int, stacked: Callable[[str], bool],
                         tolerance: float = 0.0,
                         rank: int = SUBSPACE_RANK) -> dict:
  """The geometry of the experts' task vectors (module docstring), from
  the leaves ``names``: ``base_leaf(name)`` and ``expert_leaves(name)``
  (one per domain), ``stacked(name)`` when axis 0 holds layers. Matrices
  are ``{domain: {domain: value}}``."""
  n = len(domains)
  model, kinds, layers = _Tally(n), {}, {}
  overlaps: dict[int, list] = {}
  for name in names:
    base = np.asarray(base_leaf(name), np.float64)
    taus = np.stack([np.asarray(x, np.float64) - base
                     for x in expert_leaves(name)])
    kind = kinds.setdefault(kind_of(name), _Tally(n))
    if not stacked(name):
      part = _Tally.of(taus, tolerance)
      model.add(part)
      kind.add(part)
      continue
    for layer in range(taus.shape[1]):
      part = _Tally.of(taus[:, layer], tolerance)  # each entry once
      for tally in (layers.setdefault(layer, _Tally(n)), model, kind):
        tally.add(part)
      mats = [_matrix(name, t[layer], embed_dim) for t in taus]
      if mats[0] is not None:
        spaces = [top_subspace(m, rank) for m in mats]  # once per expert
        overlaps.setdefault(layer, []).append(np.array([
            [subspace_overlap(spaces[i], spaces[j]) for j in range(n)]
            for i in range(n)]))

  def by_domain(matrix) -> dict:
    return {d: {e: float(matrix[i, j]) for j, e in enumerate(domains)}
            for i, d in enumerate(domains)}

  both = np.where(model.both > 0, model.both, 1)
  union = np.where(model.union > 0, model.union, 1)
  return dict(
      experts=list(domains), tolerance=tolerance,
      norm={d: float(np.sqrt(model.gram[i, i]))
            for i, d in enumerate(domains)},
      cosine=by_domain(model.cosine()),
      cosine_per_layer={str(l): by_domain(t.cosine())
                        for l, t in sorted(layers.items())},
      cosine_per_kind={k: by_domain(t.cosine())
                       for k, t in sorted(kinds.items())},
      sparsity={d: float(model.changed[i] / model.size)
                for i, d in enumerate(domains)},
      sign_conflict=by_domain(model.opposite / both),
      support_overlap=by_domain(model.both / union),
      subspace_overlap_per_layer={
          str(l): by_domain(np.mean(o, axis=0))
          for l, o in sorted(overlaps.items())},
      subspace_rank=rank)


def pairs(domains: Sequence[str]) -> list[tuple[str, str]]:
  return list(itertools.combinations(domains, 2))


def figures(geometry: Mapping) -> dict[str, bytes]:
  """PNG bytes: ``cosine.png`` (the whole-model cosine heatmap) and
  ``cosine_per_layer.png`` (each pair's cosine and subspace overlap
  against the layer)."""
  plt = pyplot()
  domains = geometry["experts"]
  matrix = np.array([[geometry["cosine"][d][e] for e in domains]
                     for d in domains])
  fig, ax = plt.subplots(figsize=(4.8, 4))
  image = ax.imshow(matrix, cmap="RdBu_r", vmin=-1, vmax=1)
  ax.set_xticks(range(len(domains)), domains, rotation=45)
  ax.set_yticks(range(len(domains)), domains)
  for i, j in itertools.product(range(len(domains)), repeat=2):
    ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center",
            fontsize=8)
  fig.colorbar(image, ax=ax)
  ax.set_title("task-vector cosine (whole model)")
  fig.tight_layout()
  out = {"cosine.png": png_bytes(fig)}

  layers = sorted(geometry["cosine_per_layer"], key=int)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  for d, e in pairs(domains):
    axes[0].plot([int(l) for l in layers],
                 [geometry["cosine_per_layer"][l][d][e] for l in layers],
                 marker="o", label=f"{d}-{e}")
    sub = geometry["subspace_overlap_per_layer"]
    axes[1].plot([int(l) for l in sorted(sub, key=int)],
                 [sub[l][d][e] for l in sorted(sub, key=int)], marker="o")
  axes[0].set(xlabel="layer", ylabel="cosine", title="cosine per layer")
  axes[1].set(xlabel="layer", ylabel="overlap",
              title=f"top-{geometry['subspace_rank']} subspace overlap")
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  out["cosine_per_layer.png"] = png_bytes(fig)
  return out


def write(out_dir: str, geometry: Mapping) -> None:
  """``geometry.json`` and the figures into ``out_dir`` (atomically)."""
  os.makedirs(out_dir, exist_ok=True)
  write_json_atomic(os.path.join(out_dir, GEOMETRY_FILE), dict(geometry))
  for name, data in figures(geometry).items():
    write_bytes_atomic(os.path.join(out_dir, name), data)


def from_runs(init: str, experts: str, domains: Sequence[str],
              tolerance: float = 0.0) -> dict:
  """The geometry of the expert runs ``experts`` (a ``{domain}`` template or
  ``domain=dir`` pairs) over the base run ``init``, each checked against
  the base's architecture and tokenizer."""
  base_config = runs.load_run_config(init)
  tokenizer = tokenizer_lib.of_run(init)
  runs.check_same_tokens(init, base_config, tokenizer, "--init")
  model_cfg = ModelConfig.of(base_config.model)
  dirs = runs_by_domain(experts, tuple(domains), field="--experts")
  for run_dir in dirs.values():
    run_config = runs.load_run_config(run_dir)
    runs.check_same_tokens(run_dir, run_config, tokenizer, "--experts")
    runs.check_same_model(run_dir, run_config, model_cfg, "--experts")
  mesh = parallel.make_mesh(data=-1, fsdp=1, tensor=1)
  with parallel.use_rules(parallel.DEFAULT_RULES):
    base = dict(named_leaves(runs.load_params(init, model_cfg, mesh)))
    with runs.LeafLoader(list(dirs.values()), model_cfg, mesh) as experts:
      return task_vector_geometry(
          list(base), base.__getitem__, experts, list(dirs),
          model_cfg.embed_dim, lambda n: n.startswith("layers/"), tolerance)


def main() -> None:
  values = flags.FLAGS
  write(values.out, from_runs(values.init, values.experts, values.domains,
                              values.tolerance))
  print(f"wrote {os.path.join(values.out, GEOMETRY_FILE)}")


if __name__ == "__main__":
  flags.DEFINE_string("init", None, "The base run.")
  flags.DEFINE_string("experts", None, "Expert runs: a template with"
                      " {domain} or domain=dir pairs.")
  flags.DEFINE_string("out", None, "Where geometry.json and the figures go.")
  flags.DEFINE_list("domains", list(TRAIN_DOMAINS), "The experts' domains.")
  flags.DEFINE_float("tolerance", 0.0, "|tau| above it counts as changed.")
  flags.mark_flags_as_required(["init", "experts", "out"])
  cli.run(main)
