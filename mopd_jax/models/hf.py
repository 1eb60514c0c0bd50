"""The decoder's parameters in Hugging Face's Llama / Qwen2 / Qwen3 layout.

One declarative table, ``TENSORS``, maps each of our leaves to its
Hugging Face tensor name and the layout change between them; ``to_hf`` and
``from_hf`` both read it, so the two directions cannot disagree. Our
projections keep the input axis first and split the head axes
(``q: [D, H, Dh]``); Hugging Face's ``nn.Linear`` stores ``[out, in]`` with
the heads flattened (``q_proj.weight: [H * Dh, D]``). RoPE uses the same
half-split layout on both sides, so no q/k permutation is needed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from mopd_jax.checksum import named_leaves
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig


class Tensor(NamedTuple):
  """One leaf: our path (``layers/q``), its Hugging Face name (``{i}`` the
  layer of a stacked leaf) and its layout change: ``same``; ``in_first``
  (ours ``[D, *out]``, theirs ``[prod(out), D]``); ``in_last`` (ours
  ``[*in, D]``, theirs ``[D, prod(in)]``); ``flat`` (ours ``[*dims]``,
  theirs ``[prod(dims)]``)."""
  path: str
  name: str
  layout: str


_LAYER = "model.layers.{i}."
TENSORS = (
    Tensor("embed", "model.embed_tokens.weight", "same"),
    Tensor("layers/attn_norm", _LAYER + "input_layernorm.weight", "same"),
    Tensor("layers/q", _LAYER + "self_attn.q_proj.weight", "in_first"),
    Tensor("layers/k", _LAYER + "self_attn.k_proj.weight", "in_first"),
    Tensor("layers/v", _LAYER + "self_attn.v_proj.weight", "in_first"),
    Tensor("layers/q_bias", _LAYER + "self_attn.q_proj.bias", "flat"),
    Tensor("layers/k_bias", _LAYER + "self_attn.k_proj.bias", "flat"),
    Tensor("layers/v_bias", _LAYER + "self_attn.v_proj.bias", "flat"),
    Tensor("layers/q_norm", _LAYER + "self_attn.q_norm.weight", "same"),
    Tensor("layers/k_norm", _LAYER + "self_attn.k_norm.weight", "same"),
    Tensor("layers/o", _LAYER + "self_attn.o_proj.weight", "in_last"),
    Tensor("layers/mlp_norm", _LAYER + "post_attention_layernorm.weight",
           "same"),
    Tensor("layers/gate", _LAYER + "mlp.gate_proj.weight", "in_first"),
    Tensor("layers/up", _LAYER + "mlp.up_proj.weight", "in_first"),
    Tensor("layers/down", _LAYER + "mlp.down_proj.weight", "in_last"),
    Tensor("final_norm", "model.norm.weight", "same"),
    Tensor("lm_head", "lm_head.weight", "in_first"),
)


def _to_theirs(x: np.ndarray, layout: str) -> np.ndarray:
  if layout == "in_first":
    return x.reshape(x.shape[0], -1).T
  if layout == "in_last":
    return x.reshape(-1, x.shape[-1]).T
  if layout == "flat":
    return x.reshape(-1)
  return x


def _their_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
  """``_to_theirs(x, layout).shape`` for ``x`` of ``shape``, from the
  shape alone (a config may claim sizes no memory holds)."""
  size = int(np.prod(shape, dtype=object))
  if layout == "in_first":
    return (size // shape[0], shape[0])
  if layout == "in_last":
    return (shape[-1], size // shape[-1])
  if layout == "flat":
    return (size,)
  return tuple(shape)


def _to_ours(x: np.ndarray, layout: str, shape: tuple[int, ...]
             ) -> np.ndarray:
  if layout in ("in_first", "in_last"):
    return np.ascontiguousarray(x.T).reshape(shape)
  return x.reshape(shape)


def to_hf(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """``{Hugging Face name: array}`` of our (unboxed) parameters; a stacked
  leaf becomes one tensor per layer."""
  ours = dict(named_leaves(params))
  out = {}
  for t in TENSORS:
    if t.path not in ours:
      continue
    value = np.asarray(ours[t.path])
    if t.path.startswith("layers/"):
      for i in range(cfg.num_layers):
        out[t.name.format(i=i)] = _to_theirs(value[i], t.layout)
    else:
      out[t.name] = _to_theirs(value, t.layout)
  return out


def names(cfg: ModelConfig) -> list[str]:
  """The Hugging Face names of every tensor of a model of ``cfg``."""
  ours = dict(named_leaves(jax.eval_shape(
      lambda: decoder.init_params(cfg, jax.random.key(0)))))
  return [t.name.format(i=i) for t in TENSORS if t.path in ours
          for i in (range(cfg.num_layers) if t.path.startswith("layers/")
                    else (0,))]


def from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig,
            place: Callable[[str, np.ndarray], Any] | None = None):
  """Our (unboxed) parameters from ``{Hugging Face name: array}``: the
  inverse of ``to_hf``. ``place(path, leaf)`` (e.g. ``jax.device_put``
  into the leaf's sharding) is applied to each leaf as soon as it is
  built, so the host holds one leaf at a time, not the model. Raises
  ``KeyError`` naming a missing tensor and ``ValueError`` naming one of the
  wrong shape or one whose values overflow the leaf's dtype."""
  shapes = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0)))
  params: dict = {}
  for path, shape in named_leaves(shapes):
    t = next(t for t in TENSORS if t.path == path)
    if path.startswith("layers/"):
      value = np.stack([_take(tensors, t.name.format(i=i), t.layout,
                              shape.shape[1:])
                        for i in range(cfg.num_layers)])
    else:
      value = _take(tensors, t.name, t.layout, shape.shape)
    node = params
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    if value.dtype != shape.dtype:
      with np.errstate(over="ignore"):  # said below, in one line
        value = value.astype(shape.dtype)
      if not np.isfinite(value).all():
        raise ValueError(f"tensor {t.name.replace('{i}', '*')} overflows"
                         f" {shape.dtype}")
    node[leaf] = place(path, value) if place else value
  return params


def _take(tensors, name, layout, shape):
  if name not in tensors:
    raise KeyError(f"tensor {name} is missing")
  theirs = np.asarray(tensors[name])
  expected = _their_shape(shape, layout)
  if theirs.shape != expected:
    raise ValueError(f"tensor {name} has shape {list(theirs.shape)},"
                     f" expected {list(expected)}")
  return _to_ours(theirs, layout, shape)


def hf_config(cfg: ModelConfig) -> dict:
  """The Hugging Face ``config.json`` fields of ``cfg``: Qwen3 when it has
  q/k-norm, Qwen2 when it has attention bias, Llama otherwise."""
  if cfg.qk_norm and cfg.attention_bias:
    raise ValueError("no Hugging Face family has both q/k-norm and"
                     " attention bias")
  family = ("qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias
            else "llama")
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM"}[family]
  return {
      "architectures": [arch], "model_type": family,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": cfg.attention_bias, "hidden_act": "silu",
      "torch_dtype": cfg.param_dtype,
      # transformers' own default (2048) when the model states none
      **({"max_position_embeddings": cfg.max_positions}
         if cfg.max_positions else {}),
  }
