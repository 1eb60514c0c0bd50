"""Decoder architecture hyper-parameters (Llama / Qwen2 / Qwen3 family)."""

from __future__ import annotations

import dataclasses


# Who computes attention without a KV cache (``decoder._layer``).
ATTENTION_IMPLS = ("xla", "splash", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder; hashable so it can be a jit static arg.

  ``qk_norm`` is Qwen3's per-head RMSNorm on queries and keys, ``attention_bias``
  is Qwen2's bias on the q/k/v projections, ``tie_embeddings`` reuses the input
  embedding as the output projection. ``remat`` recomputes each layer's
  activations in the backward pass instead of keeping them (memory for
  compute; values and gradients unchanged). ``attention_chunk`` > 0 attends
  over blocks of that many keys with an online softmax (``decoder.attend``):
  memory linear in the length instead of quadratic, the same values.
  ``attention_impl`` chooses who computes attention when there is no KV
  cache (training and scoring): ``xla`` (``decoder.attend``), ``splash``
  (the Pallas TPU kernel, blocks of ``attention_chunk`` or 512) or
  ``cudnn`` (cuDNN's flash attention on GPU); see ``attention_kernels``.
  ``scan_layers`` runs the layers as one ``lax.scan`` over their stacked
  weights (compile time independent of depth); off, as a loop over the
  layers sliced out once, which compiles each layer but keeps no stacked
  activations for the backward pass (on a 2-core CPU the gradient of
  SmolLM2-135M ran 1.1-1.2x faster, the built-in model's 1.2-1.4x,
  docs/performance.md); the layers' slices and their separate gradients
  cost up to one more copy of the layers' weights and gradients.
  ``max_positions`` is the longest sequence the model was trained on
  (Hugging Face's ``max_position_embeddings``; 0: none stated): RoPE
  computes any position, but past that one the outputs mean nothing, so
  longer inputs are refused rather than silently scored.
  """
  vocab_size: int = 58
  embed_dim: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: bool = False
  attention_bias: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  attention_chunk: int = 0
  attention_impl: str = "xla"
  scan_layers: bool = True
  max_positions: int = 0

  def __post_init__(self):
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={self.attention_impl!r} is not one"
                       f" of {ATTENTION_IMPLS}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of"
          f" num_kv_heads={self.num_kv_heads}")

  @classmethod
  def of(cls, section) -> "ModelConfig":
    """From a config's (or a run's) ``model`` section."""
    return cls(**section.to_dict())

  def num_params(self) -> int:
    """Parameter count, embeddings included (used for FLOP estimates)."""
    d, f, h, k, hd = (self.embed_dim, self.mlp_dim, self.num_heads,
                      self.num_kv_heads, self.head_dim)
    per_layer = d * hd * (h + 2 * k) + h * hd * d + 3 * d * f + 2 * d
    if self.attention_bias:
      per_layer += hd * (h + 2 * k)
    if self.qk_norm:
      per_layer += 2 * hd
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * per_layer + d + head


  def forward_flops_per_token(self, length: int) -> float:
    """Model FLOPs of one token's forward pass, ``2 N + 4 L H d_h T``:
    the matmuls (``N`` parameters less the input embedding lookup, which
    does no matmul; a tied table still does the output matmul) plus
    attention scores and values over ``T = length`` keys."""
    n = self.num_params() - self.vocab_size * self.embed_dim
    if self.tie_embeddings:
      n += self.vocab_size * self.embed_dim
    return 2 * n + 4 * self.num_layers * self.num_heads * self.head_dim * length

  def train_flops_per_token(self, length: int) -> float:
    """Model FLOPs of one trained token, ``6 N + 12 L H d_h T``: the
    forward pass and a backward pass of twice its FLOPs (the usual MFU
    accounting: a rematerialised forward pass is not counted)."""
    return 3 * self.forward_flops_per_token(length)


# Fields that change how a model is computed, not what: runs that differ in
# them share parameters, resume each other and combine entry by entry.
EXECUTION_FIELDS = ("remat", "attention_chunk", "attention_impl", "dtype",
                    "scan_layers")

def with_execution(cfg: ModelConfig, like: ModelConfig) -> ModelConfig:
  """``cfg``'s architecture computed as ``like`` says (its
  ``EXECUTION_FIELDS``): a teacher runs in the student's run's precision,
  remat, attention and layer loop."""
  return dataclasses.replace(
      cfg, **{k: getattr(like, k) for k in EXECUTION_FIELDS})


PRESETS = {
    "tiny": ModelConfig(),
    "micro": ModelConfig(embed_dim=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_dim=64),
    # Real architectures, bfloat16 matmuls over float32 weights.
    # Qwen3-0.6B's (q/k-norm, tied embeddings): the accelerator benchmark's.
    "qwen3_0p6b": ModelConfig(vocab_size=151936, embed_dim=1024,
                              num_layers=28, num_heads=16, num_kv_heads=8,
                              head_dim=128, mlp_dim=3072, rope_theta=1e6,
                              qk_norm=True, dtype="bfloat16"),
    # Qwen2.5-7B's (q/k/v biases, untied output layer): the memory plan's.
    "qwen7b": ModelConfig(vocab_size=152064, embed_dim=3584, num_layers=28,
                          num_heads=28, num_kv_heads=4, head_dim=128,
                          mlp_dim=18944, rope_theta=1e6,
                          tie_embeddings=False, attention_bias=True,
                          dtype="bfloat16"),
}
