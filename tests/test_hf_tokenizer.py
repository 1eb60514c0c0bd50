"""Hugging Face tokenizers: the ``HFTokenizer`` interface on a small BPE
trained here, and a Hugging Face checkpoint with its own tokenizer used
end to end (imported, trained from, evaluated, distilled into), with runs
of another tokenizer refused in one line."""

import json
import os

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from conftest import ROOT, python_m, train_cli  # noqa: E402
from mopd_jax import convert  # noqa: E402
from mopd_jax.data import domains  # noqa: E402
from mopd_jax.errors import DataError  # noqa: E402
from mopd_jax.models import tokenizer as tokenizer_lib  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}Q:{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


def save_tokenizer(directory, template=TEMPLATE, eos="<eos>"):
  """A BPE over the built-in domains' text, with BOS, EOS and PAD, saved
  as Hugging Face files in ``directory``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from tokenizers import trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
  tok.decoder = decoders.Fuse()  # spaces are tokens of their own
  texts = [e.prompt + " " + e.answer for d in domains.DOMAINS
           for e in domains.generate(d, "train", 200, seed=0)] + ["Q:A:"]
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=120, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"]))
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"bos_token": "<bos>", "eos_token": eos, "pad_token": "<pad>"}
  if template:
    config["chat_template"] = template
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return tok


def test_hf_tokenizer_prompt_decode_fingerprint(tmp_path):
  backend = save_tokenizer(tmp_path / "t")
  tok = tokenizer_lib.of_run(str(tmp_path / "t"))
  assert isinstance(tok, tokenizer_lib.HFTokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 0)
  ids = tok.prompt_ids("12+30=")
  assert ids[0] == tok.bos_id
  assert backend.decode(ids[1:]) == "Q:12+30=A:"
  answer = tok.encode("42")
  assert tok.decode(answer + [tok.eos_id] + tok.encode("junk")) == "42"
  assert tok.fits(tok.vocab_size) and tok.fits(tok.vocab_size + 64)
  assert not tok.fits(tok.vocab_size - 1)
  assert tok.fingerprint() == tokenizer_lib.of_run(
      str(tmp_path / "t")).fingerprint() != tokenizer_lib.CharTokenizer(
      ).fingerprint()
  save_tokenizer(tmp_path / "plain", template=None)
  plain = tokenizer_lib.of_run(str(tmp_path / "plain"))
  assert plain.prompt_ids("1+1=") == [1] + plain.encode("1+1=")
  assert isinstance(tokenizer_lib.of_run(str(tmp_path)),
                    tokenizer_lib.CharTokenizer)
  save_tokenizer(tmp_path / "noeos", eos="<missing>")
  with pytest.raises(DataError, match="eos_token .<missing>. is not a token"):
    tokenizer_lib.of_run(str(tmp_path / "noeos"))


def test_a_checkpoint_with_its_own_tokenizer_end_to_end(tmp_path, smoke_run,
                                                        data_dir):
  hf_dir = tmp_path / "hf"
  tok = save_tokenizer(hf_dir)
  config = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size() + 8, hidden_size=32,
      intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
      bos_token_id=1, eos_token_id=2, pad_token_id=0)
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
      hf_dir)
  base = str(tmp_path / "base")
  convert.import_hf(str(hf_dir), base)
  fingerprint = json.load(open(os.path.join(base, "config.json")))[
      "tokenizer"]
  assert fingerprint.startswith("hf-")

  # Trained as the :hf variants train real checkpoints: bfloat16 over
  # float32 weights, remat, blocked attention (prefill, cached decode and
  # flash backward); the layers as a loop, not a scan.
  expert = tmp_path / "expert"
  result = train_cli(f"--config={ROOT}/configs/grpo.py:smoke",
                     "--config.domain=add", f"--config.init={base}",
                     "--config.model.dtype=bfloat16",
                     "--config.model.remat=True",
                     "--config.model.attention_chunk=8",
                     "--config.model.scan_layers=False",
                     f"--workdir={expert}", f"--config.data.data_dir={data_dir}")
  assert result.returncode == 0, result.stderr[-3000:]
  model = json.load(open(expert / "config.json"))["model"]
  assert (model["dtype"], model["remat"], model["attention_chunk"],
          model["scan_layers"], model["embed_dim"]) == ("bfloat16", True, 8,
                                                        False, 32)
  assert os.path.exists(expert / "tokenizer.json")
  assert json.load(open(expert / "config.json"))["tokenizer"] == fingerprint
  # The imported run (whose config holds only its model and tokenizer)
  # evaluated with the settings of a config (here: completions of at most
  # 3 tokens, in bfloat16).
  result = python_m("mopd_jax.evaluate", f"--run={base}", "--num_prompts=4",
                    "--domains=add",
                    f"--settings={ROOT}/configs/mix_rl.py:smoke",
                    "--settings.sampling.max_new_tokens=3",
                    "--settings.model.dtype=bfloat16",
                    f"--settings.data.data_dir={data_dir}",
                    f"--output={tmp_path / 'eval.json'}")
  assert result.returncode == 0, result.stderr[-3000:]
  scalars = json.load(open(tmp_path / "eval.json"))
  assert 0 < scalars["eval/greedy/add/length"] <= 3

  # A teacher of the character tokenizer cannot score this student's ids.
  char_run = smoke_run[0]
  teachers = f"add={expert},chain={char_run},instruct={expert},sort={expert}"
  result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                     f"--config.init={base}", f"--config.teachers={teachers}",
                     f"--workdir={tmp_path / 'mopd'}",
                     f"--config.data.data_dir={data_dir}")
  assert result.returncode == 2
  lines = [x for x in result.stderr.splitlines() if x.strip()]
  assert len(lines) == 1 and str(char_run) in lines[0], lines
  assert not (tmp_path / "mopd").exists()

  # Of its own tokenizer, the imported run teaches with the expert (and
  # the student distils in bfloat16, its teachers held in bfloat16).
  teachers = f"add={expert},chain={base},instruct={base},sort={expert}"
  result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                     f"--config.init={base}", f"--config.teachers={teachers}",
                     "--config.model.dtype=bfloat16",
                     f"--workdir={tmp_path / 'mopd'}",
                     f"--config.data.data_dir={data_dir}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.load(open(tmp_path / "mopd" / "config.json"))["tokenizer"] == (
      fingerprint)


def test_an_empty_prompt_without_bos_or_template_is_refused(tmp_path):
  """Nothing to condition the completion's first token on: one line
  naming the line, not 5 tokens scored with 1 log-prob."""
  from mopd_jax import score
  save_tokenizer(tmp_path / "t", template=None)
  config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
  del config["bos_token"]
  (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(config))
  tok = tokenizer_lib.of_run(str(tmp_path / "t"))
  assert tok.bos_id is None and tok.prompt_ids("") == []
  lines = tmp_path / "in.jsonl"
  lines.write_text(json.dumps({"prompt": "", "completion": "12"}) + "\n")
  with pytest.raises(DataError, match=r"in.jsonl:1: field 'prompt' gives no"):
    score.parse(str(lines), tok)
