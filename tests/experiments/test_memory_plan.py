"""The memory plan's per-device estimates against XLA's memory analysis of
the compiled programs (tiny model, (2,2,2) mesh of the 8 fake devices)."""


import pytest

from conftest import load_experiment


def test_estimates_match_xla():
  checks = {name: (estimate, measured)
            for name, estimate, measured in
            load_experiment("memory_plan").check()}
  # What sits in memory between steps is exact: params, AdamW, batch, cache.
  for name in ("arguments: params + adam + batch",
               "KV cache (with its slot segment ids)"):
    estimate, measured = checks[name]
    assert measured == pytest.approx(estimate, rel=0.01), name
  # The activation formula is a lower bound within a small factor.
  estimate, measured = checks["temps: grads + activations"]
  assert estimate <= measured <= 2.5 * estimate


def test_qwen7b_table_on_a_pod_slice(capsys):
  load_experiment("memory_plan").main(["--mesh", "1,64,1", "--remat"])
  row = [l for l in capsys.readouterr().out.splitlines()
         if l.startswith("| 1,64,1")][0]
  params, adam = (float(x) for x in row.split("|")[2:4])
  # 7.62B bfloat16 parameters over 64 chips; AdamW keeps 2 x float32.
  assert params == pytest.approx(7.62e9 * 2 / 64 / 2**30, abs=0.01)
  assert adam == pytest.approx(7.62e9 * 8 / 64 / 2**30, abs=0.01)
