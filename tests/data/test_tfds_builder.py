"""Tests of the TFDS dataset of the built-in domains (no TensorFlow)."""

from __future__ import annotations

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
