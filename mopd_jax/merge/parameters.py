"""Every merge parameter, declared once, and the per-tensor settings.

``PARAMETERS`` holds each numeric parameter's mergekit name (the config
field ``merge.<name>``, the key of a name-pattern override and of the
command line's ``--config.merge.<name>=``), default, valid values and
meaning; the merge config section, its checks, the sweep's checks and the
overrides' checks all read it. ``Settings`` is one tensor's merge;
``merge.overrides`` rules give a tensor its own values (a ramp over the
layers of a stacked leaf).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from mopd_jax.errors import ConfigError

NORMALIZE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class Parameter:
  """A numeric merge parameter, declared once: its mergekit name (the
  config field ``merge.<name>`` and the key of a name-pattern override),
  default, valid values (``valid``, described by ``must_be``) and what it
  does; ``per_tensor``: whether ``merge.overrides`` can set it per tensor
  (every numeric one can, as in mergekit)."""
  name: str
  default: float
  valid: Callable[[float], bool]
  must_be: str
  help: str
  per_tensor: bool = True


PARAMETERS = {p.name: p for p in (
    Parameter("lambda", 1.0, math.isfinite, "a finite number",
              "factor on the mixed task vector"),
    Parameter("density", 1.0, lambda v: 0 < v <= 1, "in (0, 1]",
              "fraction of each task vector kept (sparsifying methods)"),
    Parameter("gamma", 0.01, lambda v: 0 <= v < 1, "in [0, 1)",
              "breadcrumbs: fraction of the largest entries dropped"),
    Parameter("t", 0.5, lambda v: 0 <= v <= 1, "in [0, 1]",
              "slerp: from the first expert (0) to the second (1)"),
    Parameter("tolerance", 0.0, lambda v: v >= 0, ">= 0",
              "sparse_union: |tau| above it counts as changed"),
)}


def settings_field(name: str) -> str:
  """The ``Settings`` field of parameter ``name`` (``lambda`` is a Python
  keyword: ``lam``)."""
  return "lam" if name == "lambda" else name


def check_parameter(name: str, value: float, where: str) -> None:
  """A ``ConfigError`` naming ``where`` unless ``value`` is valid for
  ``PARAMETERS[name]``."""
  p = PARAMETERS[name]
  if not p.valid(value):
    raise ConfigError(f"{where}: {name}={value!r} must be {p.must_be}")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The merge of one tensor. ``weights``: one per expert; ``density``:
  the fraction of each task vector kept (sparsifying methods); ``gamma``:
  breadcrumbs' fraction of largest entries dropped; ``lam``: the factor on
  the mixed task vector; ``t``: SLERP's position from the first expert to
  the second; ``tolerance``: below it an entry counts as unchanged
  (sparse_union); ``normalize``: divide the mixed task vector by the
  weights that contributed (None: the method's mergekit default);
  ``rescale``: DARE's survivors divided by ``density``."""
  method: str
  weights: tuple[float, ...]
  density: float = PARAMETERS["density"].default
  gamma: float = PARAMETERS["gamma"].default
  lam: float = PARAMETERS["lambda"].default
  t: float = PARAMETERS["t"].default
  tolerance: float = PARAMETERS["tolerance"].default
  normalize: bool | None = None
  rescale: bool = True


@dataclasses.dataclass(frozen=True)
class Override:
  """Settings for the leaves whose name matches ``pattern``
  (``re.search``); values are floats or ``(start, end)`` ramps."""
  pattern: str
  values: tuple[tuple[str, Any], ...]


def parse_overrides(spec: str) -> tuple[Override, ...]:
  """``merge.overrides``: rules ``pattern:key=value[,key=value]`` separated
  by ``;``, first match wins; a value ``a..b`` ramps over the layers of a
  stacked leaf. E.g. ``attn|q|k|v|o:density=0.7;gate|up|down:density=0.3``
  or ``layers/:lambda=0.5..1.0``."""
  rules = []
  for rule in filter(None, (r.strip() for r in spec.split(";"))):
    pattern, sep, body = rule.rpartition(":")
    if not sep or not pattern:
      raise ConfigError(f"merge.overrides: {rule!r} is not"
                        " pattern:key=value[,key=value]")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f"merge.overrides: bad pattern {pattern!r} ({e})"
                        ) from None
    values = []
    for item in filter(None, (i.strip() for i in body.split(","))):
      key, sep, value = item.partition("=")
      key = key.strip()
      if not sep or not getattr(PARAMETERS.get(key), "per_tensor", False):
        raise ConfigError(f"merge.overrides: {item!r} in rule {rule!r}: the"
                          " key must be one of " + ", ".join(
                              n for n, p in PARAMETERS.items()
                              if p.per_tensor))
      try:
        parsed = (tuple(float(v) for v in value.split(".."))
                  if ".." in value else float(value))
      except ValueError:
        raise ConfigError(f"merge.overrides: {item!r}: not a number or a"
                          " ramp a..b") from None
      if isinstance(parsed, tuple) and len(parsed) != 2:
        raise ConfigError(f"merge.overrides: {item!r}: a ramp is a..b")
      for v in parsed if isinstance(parsed, tuple) else (parsed,):
        check_parameter(key, v, f"merge.overrides: rule {rule!r}")
      values.append((key, parsed))
    rules.append(Override(pattern, tuple(values)))
  return tuple(rules)


def leaf_settings(name: str, layers: int | None, base: Settings,
                  rules: Sequence[Override]) -> dict[str, Any]:
  """The settings of leaf ``name`` (``layers``: its number of stacked
  layers, None if not stacked) as keyword values: the first matching
  rule's values over ``base``; a ramp becomes a per-layer array."""
  values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  for rule in rules:
    if re.search(rule.pattern, name):
      for key, value in rule.values:
        if isinstance(value, tuple):
          if layers is None:
            raise ConfigError(f"merge.overrides: a ramp of {key} needs"
                              f" stacked layers, {name!r} has none")
          value = np.linspace(value[0], value[1], layers).astype(np.float32)
        values[settings_field(key)] = value
      break
  return values


def check_settings(values: Mapping[str, Any], name: str) -> None:
  """Every ``PARAMETERS`` value of the tensor ``name`` (a number, or one
  per layer) valid: a ConfigError naming the field otherwise."""
  for key, p in PARAMETERS.items():
    value = values[settings_field(key)]
    if not all(p.valid(float(v)) for v in np.ravel(value)):
      raise ConfigError(f"merge.{key}: must be {p.must_be}, got"
                        f" {value!r} for {name}")


