import pytest

from mopd_jax.errors import DataError
from mopd_jax.models.tokenizer import ALPHABET, CharTokenizer


def test_round_trip_and_specials():
  tok = CharTokenizer()
  assert tok.vocab_size == len(ALPHABET) + 3
  assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
  ids = tok.encode("sum 12 7:12+7=19;#19")
  assert min(ids) >= 3
  assert tok.decode(ids) == "sum 12 7:12+7=19;#19"
  # Decoding stops at EOS and drops PAD/BOS.
  assert tok.decode([tok.bos_id] + tok.encode("ab") + [tok.eos_id]
                    + tok.encode("cd")) == "ab"
  assert tok.decode([tok.pad_id] + tok.encode("x")) == "x"


def test_unknown_character_is_a_data_error():
  with pytest.raises(DataError, match="'A'"):
    CharTokenizer().encode("aAb")


def test_fingerprint_identifies_vocabulary():
  assert CharTokenizer().fingerprint() == CharTokenizer().fingerprint()
  assert CharTokenizer("ab").fingerprint() != CharTokenizer("ba").fingerprint()


def test_character_tokenizer_as_hugging_face_files_keeps_every_id(tmp_path):
  pytest.importorskip("tokenizers")
  from mopd_jax.models.tokenizer import HFTokenizer
  char = CharTokenizer()
  char.save_hf(str(tmp_path))
  hf = HFTokenizer(str(tmp_path))
  text = "12+30=42 sort qbfa: #49"
  assert hf.encode(text) == char.encode(text)
  assert hf.prompt_ids(text) == char.prompt_ids(text)
  assert hf.decode(char.encode(text) + [char.eos_id, 5]) == text
  assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id) == (
      char.vocab_size, char.pad_id, char.bos_id, char.eos_id)
