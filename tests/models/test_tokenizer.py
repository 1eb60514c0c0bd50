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


def _damaged(directory, how):
  """A Hugging Face tokenizer directory damaged one way."""
  import json
  import os
  CharTokenizer().save_hf(str(directory))
  config = directory / "tokenizer_config.json"
  if how == "surrogate_eos":  # JSON's escape of a lone surrogate
    config.write_text(config.read_text().replace('"<eos>"', '"\\ud800"'))
  elif how == "empty_template":
    config.write_text(json.dumps(dict(json.loads(config.read_text()),
                                      chat_template="")))
  elif how == "eos_id_past_vocab":
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 100000]}))
  elif how == "fifo":
    os.remove(directory / "tokenizer.json")
    os.mkfifo(directory / "tokenizer.json")
  else:  # an id past the count of tokens: the range is what a model needs
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["z"] = 500
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize("how,words", [
    ("surrogate_eos", "tokenizer_config.json: eos_token: a string holds a"
     " lone surrogate"),
    ("empty_template", "renders a prompt as no tokens"),
    ("eos_id_past_vocab", "generation_config.json: eos_token_id: expected a"
     " token id below the tokenizer's 58"),
    ("fifo", "tokenizer.json: not a regular file"),
])
def test_a_damaged_tokenizer_is_one_line(tmp_path, how, words):
  pytest.importorskip("tokenizers")
  from mopd_jax.models.tokenizer import HFTokenizer
  _damaged(tmp_path, how)
  with pytest.raises(DataError, match=words):
    HFTokenizer(str(tmp_path))


def test_the_vocabulary_is_the_range_of_its_ids(tmp_path):
  pytest.importorskip("tokenizers")
  from mopd_jax.models.tokenizer import HFTokenizer
  _damaged(tmp_path, "sparse_id")
  tokenizer = HFTokenizer(str(tmp_path))
  assert tokenizer.vocab_size == 501
  assert not tokenizer.fits(CharTokenizer().vocab_size)


def test_no_chat_template_is_said_once_and_only_then(tmp_path, capsys):
  pytest.importorskip("tokenizers")
  import json
  from mopd_jax.models.tokenizer import HFTokenizer
  plain, chat = tmp_path / "plain", tmp_path / "chat"
  for directory in (plain, chat):
    CharTokenizer().save_hf(str(directory))
  config = json.loads((chat / "tokenizer_config.json").read_text())
  (chat / "tokenizer_config.json").write_text(json.dumps(dict(
      config, chat_template="{{ bos_token }}q{{ messages[0].content }}a")))
  HFTokenizer(str(chat))
  assert "chat template" not in capsys.readouterr().out
  HFTokenizer(str(plain))
  HFTokenizer(str(plain))
  assert capsys.readouterr().out.count("has no chat template") == 1
