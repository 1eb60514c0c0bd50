"""mopd_jax: Merge, Mix RL and multi-teacher on-policy distillation in JAX."""

from mopd_jax import host_memory

__version__ = "0.1.0"

# before anything starts XLA's threads (host_memory's docstring)
host_memory.keep_freed_memory()
