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
  temps = [name for name in checks if name.startswith("temps")]
  assert len(temps) == 5
  for name in temps:
    estimate, measured = checks[name]
    assert estimate <= measured <= 2.5 * estimate, name
  # Dense attention's temps grow with T^2 (3.4x from 1,024 to 2,048
  # tokens), blocked attention's with T (2.1x).
  dense = [checks[f"temps at T={t}, dense attention"][1] for t in (1024, 2048)]
  blocked = [checks[f"temps at T={t}, blocked (256 keys) attention"][1]
             for t in (1024, 2048)]
  assert dense[1] > 3.0 * dense[0]
  assert blocked[1] < 2.3 * blocked[0]
  assert blocked[1] < 0.3 * dense[1]


def test_qwen7b_table_on_a_pod_slice(capsys):
  load_experiment("memory_plan").main(
      ["--mesh", "1,64,1", "--remat", "--chunk", "512", "--mfu", "0.4",
       "--peak_tflops", "197"])
  row = [l for l in capsys.readouterr().out.splitlines()
         if l.startswith("| 1,64,1")][0]
  cells = [c.strip() for c in row.split("|")[2:-1]]
  params, adam, _, teachers = (float(x) for x in cells[:4])
  # 7.62B float32 master weights over 64 chips; AdamW keeps 2 x float32;
  # three bfloat16 teachers.
  assert params == pytest.approx(7.62e9 * 4 / 64 / 2**30, abs=0.01)
  assert adam == pytest.approx(7.62e9 * 8 / 64 / 2**30, abs=0.01)
  assert teachers == pytest.approx(3 * 7.62e9 * 2 / 64 / 2**30, abs=0.01)
  assert int(cells[-2].rstrip("%")) < 80
  # 64 chips at 40% of 197 TFLOP/s over 6 N + 12 L H d_h T model FLOPs a
  # token, N without the input embedding table (untied: a lookup).
  n = 7_615_616_512 - 152064 * 3584
  flops = 6 * n + 12 * 28 * 28 * 128 * 2048
  assert float(cells[-1].replace(",", "")) == pytest.approx(
      64 * 0.4 * 197e12 / flops, rel=1e-3)
