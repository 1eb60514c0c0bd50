import numpy as np
import pytest

from mopd_jax.data import batching
from mopd_jax.data.domains import Example
from mopd_jax.errors import DataError
from mopd_jax.models.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _stream(examples):
  it = iter(examples)
  return lambda: next(it)


def test_pack_first_fit_layout():
  exs = [Example("add 1+2=", "3", "add"), Example("rev ab:", "ba", "reverse"),
         Example("add 10+20=", "30", "add"), Example("sort cba:", "abc", "sort"),
         Example("x" * 3, "y", "add")]
  arrays, packed = batching.pack_demonstrations(_stream(exs), TOK, 2, 22)
  # 11 + 11 tokens fill row 0, 14 go to row 1, the next 14 fit nowhere.
  assert packed == exs[:3]
  tok, seg, mask = arrays["tokens"], arrays["segment_ids"], arrays["loss_mask"]
  assert list(seg[0]) == [1] * 11 + [2] * 11
  assert list(seg[1]) == [1] * 14 + [0] * 8
  assert TOK.decode(tok[0, 1:11]) == "add 1+2=3"
  assert tok[0, 10] == TOK.eos_id and tok[0, 11] == TOK.bos_id
  # Loss on answer + EOS only.
  np.testing.assert_array_equal(np.flatnonzero(mask[0]), [9, 10, 19, 20, 21])
  np.testing.assert_array_equal(np.flatnonzero(mask[1]), [11, 12, 13])


def test_too_long_demonstration_is_named():
  with pytest.raises(DataError, match="exceed the sequence length 8"):
    batching.pack_demonstrations(
        _stream([Example("sum 1 2 3:", "1+2=3;3+3=6;#6", "chain")]), TOK, 1, 8)


def test_prompts_are_left_padded():
  tokens, mask = batching.encode_prompts(["rev ab:", "add 1+2="], TOK, 12)
  np.testing.assert_array_equal(mask.sum(1), [8, 9])
  assert tokens[0, 4] == TOK.bos_id and tokens[1, 3] == TOK.bos_id
  assert np.all(tokens[0, :4] == TOK.pad_id)
  assert TOK.decode(tokens[1]) == "add 1+2="
  with pytest.raises(DataError, match="max_prompt_len=4"):
    batching.encode_prompts(["add 1+2="], TOK, 4)
