"""Tests of the TFDS dataset of the built-in domains (no TensorFlow)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mopd_jax.data import domains, tfds_builder
from mopd_jax.errors import DataError

SIZES = {"num_train": 64, "num_test": 16}


@pytest.mark.parametrize("name", tuple(domains.DOMAINS))
def test_load_split_matches_generate(tmp_path, name):
  for split, n in (("train", 64), ("test", 16), ("validation", 16)):
    source = tfds_builder.load_split(name, split, str(tmp_path), seed=3,
                                     **SIZES)
    assert len(source) == n
    assert list(source) == domains.generate(name, split, n, seed=3)
    assert source[-1] == source[n - 1]
    assert source.__getitems__([5, 0]) == [source[5], source[0]]
  assert "tensorflow" not in sys.modules


def _mtimes(root) -> list[int]:
  return sorted(p.stat().st_mtime_ns for p in root.rglob("*.array_record*"))


def test_reload_reuses_the_built_dataset(tmp_path):
  first = tfds_builder.load_split("add", "train", str(tmp_path), **SIZES)
  files = _mtimes(tmp_path)
  again = tfds_builder.load_split("add", "train", str(tmp_path), **SIZES)
  assert list(again) == list(first)
  assert _mtimes(tmp_path) == files


def test_different_seed_or_size_is_a_different_dataset(tmp_path):
  a = tfds_builder.load_split("sort", "train", str(tmp_path), seed=0, **SIZES)
  b = tfds_builder.load_split("sort", "train", str(tmp_path), seed=1, **SIZES)
  c = tfds_builder.load_split("sort", "train", str(tmp_path), seed=0,
                              num_train=32, num_test=16)
  assert list(a) != list(b)
  assert len(c) == 32 and list(c) == list(a)[:32]


def test_index_out_of_range(tmp_path):
  source = tfds_builder.load_split("reverse", "test", str(tmp_path), **SIZES)
  with pytest.raises(IndexError):
    source[16]
  with pytest.raises(IndexError):
    source.__getitems__([0, 16])


def test_bad_arguments(tmp_path):
  with pytest.raises(DataError, match="unknown domain 'mul'"):
    tfds_builder.load_split("mul", "train", str(tmp_path))
  with pytest.raises(DataError, match="unknown split 'dev'"):
    tfds_builder.load_split("add", "dev", str(tmp_path))
  with pytest.raises(DataError, match="num_test >= 1"):
    tfds_builder.load_split("add", "train", str(tmp_path), num_test=0)
  with pytest.raises(DataError, match="seed >= 0"):
    tfds_builder.load_split("add", "train", str(tmp_path), seed=-1)


def _built(data_dir):
  """A small built ``add`` dataset in ``data_dir`` and its version folder."""
  source = tfds_builder.load_split("add", "train", str(data_dir),
                                   num_train=64, num_test=16)
  folder = os.path.join(str(data_dir), "mopd_domains",
                        "add_seed0_train64_test16",
                        str(tfds_builder.MopdDomains.VERSION))
  return [source[i] for i in range(len(source))], folder


@pytest.mark.parametrize("damage", ["truncate", "garbage_info"])
def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, capsys, damage):
  """The built dataset is derived data: damaged, it is rebuilt (a warning
  line), never served or reported as the user's error."""
  examples, folder = _built(tmp_path)
  if damage == "truncate":
    path = os.path.join(folder, next(n for n in os.listdir(folder)
                                     if "train.array_record" in n))
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
      f.write("garbage{")
  capsys.readouterr()
  again, _ = _built(tmp_path)
  assert again == examples
  err = capsys.readouterr().err
  assert "warning: the 'add' dataset in" in err and "rebuilding it" in err


def test_a_data_dir_that_is_a_file_is_one_line(tmp_path):
  path = tmp_path / "file"
  path.write_text("x")
  with pytest.raises(DataError, match=(
      f"data.data_dir: cannot build the 'add' dataset in {path}"
      " .NotADirectoryError")):
    tfds_builder.load_split("add", "train", str(path), num_train=64,
                            num_test=16)


def test_a_data_dir_nothing_can_be_written_into_is_one_line(tmp_path):
  folder = tmp_path / "locked"
  folder.mkdir()
  if subprocess.run(["chattr", "+i", str(folder)],
                    capture_output=True).returncode:
    pytest.skip("chattr +i is not available here")
  try:
    with pytest.raises(DataError, match=(
        f"data.data_dir: cannot build the 'add' dataset in {folder} .")):
      tfds_builder.load_split("add", "train", str(folder), num_train=64,
                              num_test=16)
  finally:
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_the_default_sizes_build_in_a_fresh_data_dir(tmp_path, capsys):
  """The default sizes use the registered config (a name, not a
  DomainConfig): a fresh data dir builds it, and a damaged one rebuilds."""
  source = tfds_builder.load_split("reverse", "test", str(tmp_path))
  assert len(source) == tfds_builder.DEFAULT_NUM_TEST
  assert list(source)[:3] == domains.generate("reverse", "test", 3, seed=0)
  assert "building the 'reverse' dataset in" in capsys.readouterr().out
  folder = os.path.join(tmp_path, tfds_builder.MopdDomains.name, "reverse",
                        str(tfds_builder.MopdDomains.VERSION))
  with open(os.path.join(folder, "dataset_info.json"), "w") as f:
    f.write("garbage{")
  again = tfds_builder.load_split("reverse", "test", str(tmp_path))
  assert list(again) == list(source)
  assert "rebuilding it" in capsys.readouterr().err


def test_processes_sharing_a_data_dir_wait_for_one_build(tmp_path):
  """A study's seeds run as processes over one data_dir: each waits for
  the build another started, none takes its half-written files for a
  damaged dataset (it had rebuilt, or failed, under the other's feet)."""
  code = ("import sys; from mopd_jax.data import tfds_builder;"
          "print(len(tfds_builder.load_split('sort', 'test', sys.argv[1],"
          " num_train=256, num_test=16)))")
  procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(3)]
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and out.strip().endswith("16"), err[-2000:]
    assert "rebuilding" not in err


def test_a_built_dataset_reads_from_a_read_only_data_dir(tmp_path):
  built = tfds_builder.load_split("add", "test", str(tmp_path), **SIZES)
  folder = tmp_path / tfds_builder.MopdDomains.name
  for lock in folder.glob("*.lock"):  # as a copied cache would come
    lock.unlink()
  if subprocess.run(["chattr", "+i", str(folder)],
                    capture_output=True).returncode:
    pytest.skip("chattr +i is not available here")
  try:
    again = tfds_builder.load_split("add", "test", str(tmp_path), **SIZES)
  finally:
    subprocess.run(["chattr", "-i", str(folder)], check=True)
  assert len(again) == len(built)
