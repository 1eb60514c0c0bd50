"""Nothing a run loads can run code: checkpoints and data are read with
Orbax, safetensors, JSON and array_record only, never with pickle, and no
text is evaluated. A grep over the package, configs and experiments."""

import os
import re

from conftest import ROOT

# Word-boundary aware: ``evaluate(`` and a method ``x.eval(`` do not count.
FORBIDDEN = re.compile(
    r"\b(?:c?pickle|cloudpickle|dill|shelve|marshal|joblib|jsonpickle)\b"
    r"|(?<![\w.])(?:eval|exec)\s*\("
    r"|allow_pickle\s*=\s*True"
    r"|\btorch\.load\b|\byaml\.(?:unsafe_)?load\s*\(")


def _sources():
  for top in ("mopd_jax", "configs", "experiments"):
    for directory, _, names in os.walk(os.path.join(ROOT, top)):
      yield from (os.path.join(directory, n) for n in names
                  if n.endswith(".py"))


def test_no_pickle_eval_or_exec_in_the_sources():
  hits = [f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}"
          for path in _sources()
          for number, line in enumerate(open(path, encoding="utf-8"), 1)
          if FORBIDDEN.search(line)]
  assert not hits, "\n".join(hits)


def test_the_pattern_catches_what_it_should():
  for bad in ("import pickle", "np.load(f, allow_pickle=True)", "eval(text)",
              "x = exec (code)", "yaml.load(f)", "import dill"):
    assert FORBIDDEN.search(bad), bad
  for fine in ("accuracy.evaluate(params)", "model.eval()", "evaluation",
               "def make_eval_fn(", "np.load(f, allow_pickle=False)",
               "pickled_state = 1"):
    assert not FORBIDDEN.search(fine), fine
