"""Chat templates as transformers finds and renders them, under limits.

``find(directory, tokenizer_config)`` applies transformers' rules: a
``chat_template.jinja`` file (and named templates in
``additional_chat_templates/*.jinja``) takes priority over the
``chat_template`` of ``tokenizer_config.json``, which is a string or a list
of ``{"name", "template"}``; of several templates the one named ``default``
is used. ``Template`` compiles one in the environment transformers uses
(the immutable sandbox with ``trim_blocks``, ``lstrip_blocks`` and loop
controls; the globals ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``; a ``tojson`` that does not escape HTML) and renders it with
the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables, as ``apply_chat_template`` does.

A template from a hub is untrusted code. Rendering is bounded: no constant
folding while compiling (Jinja would otherwise evaluate ``'x' * 10**10``
then), ``+``, ``*`` and ``**`` refuse results over ``MAX_CHARS`` (strings,
lists) or ``MAX_BITS`` (numbers), a render stops after ``TIME_LIMIT_S`` (on
the main thread, where the entry points render) and its output is at most
``MAX_CHARS`` characters. Every failure is one ``DataError`` line naming
the template's file.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import threading

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

from mopd_jax import json_files
from mopd_jax.data.records import check_text
from mopd_jax.errors import DataError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
MAX_CHARS = 1 << 20  # a rendered chat, or any string or list built on the way
MAX_BITS = 4096  # of an integer built by ``*`` or ``**``
TIME_LIMIT_S = 5.0


def find(directory: str, tokenizer_config: dict) -> tuple[str, str] | None:
  """``(template source, where it was found)`` of the checkpoint in
  ``directory``, or None when it has none (transformers' rules, above)."""
  templates = {}
  raw = tokenizer_config.get("chat_template")
  where = os.path.join(directory, "tokenizer_config.json")
  if isinstance(raw, str):
    templates["default"] = (raw, where)
  elif isinstance(raw, list):
    for entry in raw:
      if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
              and isinstance(entry.get("template"), str)):
        raise DataError(f"{where}: chat_template: each entry of the list"
                        " must be {\"name\": str, \"template\": str}")
      templates[entry["name"]] = (entry["template"], where)
  elif raw is not None:
    raise DataError(f"{where}: chat_template: expected a string or a list,"
                    f" got {type(raw).__name__}")
  files = {}
  path = os.path.join(directory, TEMPLATE_FILE)
  if os.path.isfile(path):
    files["default"] = path
  extra = os.path.join(directory, TEMPLATE_DIR)
  if os.path.isdir(extra):
    for name in sorted(os.listdir(extra)):
      if name.endswith(".jinja"):
        files[name[:-len(".jinja")]] = os.path.join(extra, name)
  if files:  # template files replace every template of the config
    templates = {name: (_read(p), p) for name, p in files.items()}
  if not templates:
    return None
  if "default" not in templates:
    if len(templates) > 1:
      raise DataError(f"{directory}: several chat templates"
                      f" ({', '.join(sorted(templates))}) and none named"
                      " 'default'")
    return next(iter(templates.values()))
  return templates["default"]


def _read(path: str) -> str:
  json_files.regular_file(path, DataError)
  try:
    with open(path, encoding="utf-8") as f:
      return f.read(MAX_CHARS + 1)  # Template refuses a longer one
  except (OSError, UnicodeDecodeError) as e:
    raise DataError(f"{path}: unreadable ({type(e).__name__}: {e})"
                    ) from None


def _too_big(value) -> bool:
  if isinstance(value, (str, list, tuple)):
    return len(value) > MAX_CHARS
  if isinstance(value, int) and not isinstance(value, bool):
    return value.bit_length() > MAX_BITS
  return False


def _size_of_product(left, right) -> int:
  """An upper bound on the length of ``left * right`` for a sequence times
  an integer, before it is built."""
  for seq, n in ((left, right), (right, left)):
    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
      return len(seq) * max(n, 0)
  return 0


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
  """transformers' environment, with the arithmetic that can build an
  unbounded value checked before it runs."""

  intercepted_binops = frozenset({"+", "*", "**"})

  def call_binop(self, context, operator, left, right):
    if operator == "*" and _size_of_product(left, right) > MAX_CHARS:
      raise jinja2.sandbox.SecurityError(
          f"'*' would build a value over {MAX_CHARS} items")
    if operator == "**" and isinstance(left, int) and isinstance(
        right, int) and abs(left) > 1 and right * max(
            abs(left).bit_length(), 1) > MAX_BITS:
      raise jinja2.sandbox.SecurityError(
          f"'**' would build a number over {MAX_BITS} bits")
    if operator == "+" and isinstance(left, (str, list, tuple)) and (
        isinstance(right, (str, list, tuple))) and len(left) + len(
            right) > MAX_CHARS:
      raise jinja2.sandbox.SecurityError(
          f"'+' would build a value over {MAX_CHARS} items")
    result = super().call_binop(context, operator, left, right)
    if _too_big(result):
      raise jinja2.sandbox.SecurityError(
          f"{operator!r} built a value over the template's limits")
    return result


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None,
            sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


class _Dict:
  """``dict`` for templates without its attributes (transformers' own)."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
  """``namespace`` refusing underscore attributes, as transformers'."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.sandbox.SecurityError(
          f"namespace attribute {name!r} starts with '_'")


class _Generation(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` (transformers' assistant
  mask tag) renders its body; the mask itself is not needed here."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                  ).set_lineno(lineno)

  def _body(self, caller):
    return caller()


class _TimeLimit(Exception):
  pass


@contextlib.contextmanager
def _time_limit(seconds: float):
  """Raise ``_TimeLimit`` in the body after ``seconds`` (main thread only:
  elsewhere signals cannot interrupt it, and the body runs unbounded)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def expire(signum, frame):
    raise _TimeLimit()

  previous = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


class Template:
  """One chat template (``source``, found at ``where``), compiled once."""

  def __init__(self, source: str, where: str):
    self.source, self.where = source, where
    if len(source) > MAX_CHARS:
      raise DataError(f"{where}: chat template over {MAX_CHARS} characters")
    # optimized=False: no constant folding while compiling
    env = _Environment(trim_blocks=True, lstrip_blocks=True, optimized=False,
                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
        dict=_Dict(), namespace=_Namespace)
    try:
      with _time_limit(TIME_LIMIT_S):
        self._compiled = env.from_string(source)
    except _TimeLimit:
      raise DataError(f"{where}: the chat template did not compile within"
                      f" {TIME_LIMIT_S:g} s") from None
    except (jinja2.TemplateError, RecursionError, MemoryError) as e:
      raise DataError(f"{where}: the chat template does not compile"
                      f" ({_why(e)})") from None

  def render(self, messages, add_generation_prompt: bool = True,
             **variables) -> str:
    """The chat text of ``messages``, as ``apply_chat_template(...,
    tokenize=False)`` writes it."""
    try:
      with _time_limit(TIME_LIMIT_S):
        text = self._compiled.render(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **variables)
    except _TimeLimit:
      raise DataError(f"{self.where}: the chat template ran over"
                      f" {TIME_LIMIT_S:g} s") from None
    except Exception as e:  # pylint: disable=broad-except
      # Whatever a template raises (raise_exception, an undefined name, the
      # sandbox refusing an attribute, a type error) is the template's.
      raise DataError(f"{self.where}: the chat template failed"
                      f" ({_why(e)})") from None
    if len(text) > MAX_CHARS:
      raise DataError(f"{self.where}: the chat template wrote over"
                      f" {MAX_CHARS} characters")
    check_text(text, f"{self.where}: the chat template's output")
    return text


def _why(error: Exception) -> str:
  text = " ".join(str(error).split())[:200]
  line = getattr(error, "lineno", None)
  return (f"line {line}: " if line else "") + (
      f"{type(error).__name__}: {text}" if text else type(error).__name__)
