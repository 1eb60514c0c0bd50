"""Chat templates: found by transformers' rules, rendered as transformers
renders them (checked against ``apply_chat_template`` itself), and a
hostile template stopped by its limits with one line naming its file."""

import json
import time

import pytest

from mopd_jax.errors import DataError
from mopd_jax.models import chat_template

transformers = pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' +"
          " m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
# Globals, filters and tags transformers' environment has.
RICH = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% set ns.n = ns.n + 1 %}{% if loop.index > 5 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% generation %}[{{ m.content | upper }}]"
        "{% endgeneration %}{% endfor %}{{ dict(a=ns.n) | tojson }}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")


def _write(directory, config=None, jinja=None, extra=None):
  directory.mkdir(parents=True, exist_ok=True)
  if jinja is not None:
    (directory / chat_template.TEMPLATE_FILE).write_text(jinja)
  for name, text in (extra or {}).items():
    (directory / chat_template.TEMPLATE_DIR).mkdir(exist_ok=True)
    (directory / chat_template.TEMPLATE_DIR / f"{name}.jinja").write_text(
        text)
  return str(directory), config or {}


def test_found_by_transformers_rules(tmp_path):
  d, config = _write(tmp_path / "a", {"chat_template": "config"},
                     jinja="file")
  assert chat_template.find(d, config)[0] == "file"  # the file wins
  d, config = _write(tmp_path / "b", {"chat_template": [
      {"name": "tool_use", "template": "tools"},
      {"name": "default", "template": "plain"}]})
  assert chat_template.find(d, config)[0] == "plain"
  d, config = _write(tmp_path / "c", extra={"only": "named"})
  assert chat_template.find(d, config)[0] == "named"
  d, config = _write(tmp_path / "d", extra={"x": "1", "y": "2"})
  with pytest.raises(DataError, match="none named 'default'"):
    chat_template.find(d, config)
  assert chat_template.find(*_write(tmp_path / "e")) is None
  with pytest.raises(DataError, match="chat_template: expected"):
    chat_template.find(*_write(tmp_path / "f", {"chat_template": 3}))


@pytest.mark.parametrize("template", [CHATML, RICH])
def test_renders_as_apply_chat_template(tmp_path, template):
  """transformers' own rendering of the same template, messages and
  special tokens is the reference."""
  from tokenizers import Tokenizer, models
  backend = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2},
                                       unk_token="<unk>"))
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
       "chat_template": template}))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = chat_template.Template(template, "t")
  for messages in ([{"role": "user", "content": "Hi <b>there</b> \u00e9"}],
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"}]):
    for add in (True, False):
      want = theirs.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add)
      assert ours.render(messages, add, bos_token="<s>", eos_token="</s>",
                         unk_token="<unk>") == want


@pytest.mark.parametrize("source,words", [
    ("{{ 'x' * 10**10 }}", "over"),  # Jinja would fold it while compiling
    ("{{ 10 ** 100000 }}", "over"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", "over"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}"
     "{% endfor %}{% endfor %}", "ran over"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% for %}", "does not compile"),
    ("{{ messages.__class__.__mro__ }}", "SecurityError|failed"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed"),
    ("{{ undefined_name.attr }}", "failed"),
    ("{{ '\\ud800' }}", "lone surrogate"),  # text no tokenizer encodes
])
def test_a_hostile_or_broken_template_is_one_line(source, words,
                                                  monkeypatch):
  monkeypatch.setattr(chat_template, "TIME_LIMIT_S", 1.0)
  start = time.monotonic()
  with pytest.raises(DataError, match=words) as error:
    chat_template.Template(source, "ckpt/chat_template.jinja").render(
        [{"role": "user", "content": "hi"}])
  assert str(error.value).startswith("ckpt/chat_template.jinja: ")
  assert "\n" not in str(error.value)
  assert time.monotonic() - start < 10
