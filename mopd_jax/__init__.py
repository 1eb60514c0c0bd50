"""mopd_jax: Merge, Mix RL and multi-teacher on-policy distillation in JAX."""

__version__ = "0.1.0"
