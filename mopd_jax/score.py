"""Per-token log-probs of a model, and the MOPD signal against a teacher.

    python -m mopd_jax.score --model=RUN --input=IN.jsonl --output=OUT.jsonl \
        [--teacher=RUN] [--batch_size=32]

``RUN`` is a run directory or a Hugging Face checkpoint directory (read
as ``convert import`` would, nothing written into it). Each input line is
``{"text": ...}`` (tokenized as ``tokenizer(text)`` reads it; every token
after the first is scored) or ``{"prompt": ..., "completion": ...}`` (the completion's tokens
and the EOS that ends it, given the prompt as the model reads it: BOS or
the chat template first). The tokenizer is the model run's own. Each output line, in input
order, has ``tokens`` (the scored token ids), ``pieces`` (their text) and
``logprobs`` (``log pi(y_t | y_<t)`` under ``--model``). With
``--teacher`` (a run of the same tokenizer) it also has
``teacher_logprobs`` (``log T(y_t | y_<t)``), ``signal`` (``log T(y_t) -
log pi(y_t)``, the per-token signal MOPD's ``pg`` loss follows, whose mean
over sampled tokens estimates ``-KL(pi || T)``) and ``reverse_kl`` (the
exact ``KL(pi || T) = sum_v pi(v) (log pi(v) - log T(v))`` at each
position, what ``opd.loss=kl`` minimises). Every input line is checked
before any scoring, its length against the models'
``max_position_embeddings`` too: a bad line is ``file:line: what is
wrong`` and exit code 2, and the output is written whole or not at all.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import jax
import numpy as np
from absl import flags

from mopd_jax import cli, convert, runs
from mopd_jax.atomic import write_text_atomic
from mopd_jax.data.jsonl import json_records
from mopd_jax.errors import DataError, UserError
from mopd_jax.models import decoder
from mopd_jax.models import tokenizer as tokenizer_lib
from mopd_jax.ops import vocab



def parse(path: str, tokenizer, max_length: int = 0
          ) -> list[tuple[list[int], int]]:
  """``(token ids, index of the first scored token)`` per line of the
  JSONL file at ``path``, in order; a line of more than ``max_length``
  tokens (when > 0) is a ``DataError``."""
  out = []
  for where, record in json_records(path):
    keys = sorted(k for k in ("text", "prompt", "completion") if k in record)
    if keys not in (["text"], ["completion", "prompt"]):
      raise DataError(f"{where}: expected the field 'text', or the fields"
                      " 'prompt' and 'completion'")
    for key in keys:
      if not isinstance(record[key], str):
        raise DataError(f"{where}: field {key!r} must be a string, got"
                        f" {type(record[key]).__name__}")
    try:
      if keys == ["text"]:
        ids = tokenizer.text_ids(record["text"])
        first = 1  # the first token has nothing before it
      else:
        prompt = tokenizer.prompt_ids(record["prompt"])
        ids = prompt + tokenizer.encode(record["completion"]) + [
            tokenizer.eos_id]
        first = len(prompt)
    except DataError as e:
      raise DataError(f"{where}: {e}") from None
    if first == 0:
      raise DataError(f"{where}: field 'prompt' gives no tokens (this"
                      " tokenizer has no BOS and no chat template), so the"
                      " completion's first token has nothing to follow")
    if first >= len(ids):
      raise DataError(f"{where}: field 'text' has at most one token:"
                      " nothing to score")
    if max_length and len(ids) > max_length:
      raise DataError(f"{where}: {len(ids)} tokens, more than the model's"
                      f" max_position_embeddings {max_length}")
    out.append((ids, first))
  if not out:
    raise DataError(f"{path}: no lines to score")
  return out


@functools.partial(jax.jit, static_argnums=0)
def _hidden(cfg, params, ids, segments):
  """Final hidden states [B, T - 1, D] at every position that predicts a
  next token, and the unembedding [D, V]."""
  h, _ = decoder.hidden_states(params, cfg, ids, segments)
  return h[:, :-1], decoder.output_weight(params, cfg)


@jax.jit
def _scores(h, w, ids, mask):
  """Each next token's log-prob [B, T - 1], through the fused vocabulary
  op (no [B, T, V] logits)."""
  return vocab.token_logprobs(h, w.astype(h.dtype), ids[:, 1:], mask=mask)


@jax.jit
def _reverse_kl(h, w, teacher_h, teacher_w, mask):
  """``KL(pi || T)`` at every position [B, T - 1], fused likewise."""
  return vocab.vocab_kl(h, w.astype(h.dtype), teacher_h,
                        teacher_w.astype(teacher_h.dtype),
                        mask=mask).reverse


def score_lines(lines, tokenizer, model, teacher=None, batch_size: int = 32
                ) -> list[dict]:
  """One record per line (``parse``'s output) for ``model``
  (``(cfg, params)``) and optionally ``teacher``."""
  records = []
  for start in range(0, len(lines), batch_size):
    chunk = lines[start:start + batch_size]
    width = max(len(ids) for ids, _ in chunk)
    ids = np.zeros((len(chunk), width), np.int32)
    segments = np.zeros_like(ids)
    for row, (line, _) in enumerate(chunk):
      ids[row, :len(line)], segments[row, :len(line)] = line, 1
    mask = segments[:, 1:]
    h, w = _hidden(*model, ids, segments)
    picked = np.asarray(_scores(h, w, ids, mask))
    if teacher is not None:
      t_h, t_w = _hidden(*teacher, ids, segments)
      t_picked = np.asarray(_scores(t_h, t_w, ids, mask))
      kl = np.asarray(_reverse_kl(h, w, t_h, t_w, mask))
    for row, (line, first) in enumerate(chunk):
      scored = slice(first - 1, len(line) - 1)  # position t predicts t + 1
      record = {"tokens": line[first:],
                "pieces": [tokenizer.piece(i) for i in line[first:]],
                "logprobs": picked[row, scored].tolist()}
      if teacher is not None:
        record["teacher_logprobs"] = t_picked[row, scored].tolist()
        record["signal"] = (t_picked[row, scored]
                            - picked[row, scored]).tolist()
        record["reverse_kl"] = kl[row, scored].tolist()
      records.append(record)
  return records


def load(path: str, field: str, tokenizer, stack: contextlib.ExitStack):
  """``(cfg, params)`` of the run (or Hugging Face checkpoint) in ``path``,
  which must share ``tokenizer``'s token ids (``field`` names the flag in
  errors)."""
  run_dir = stack.enter_context(convert.as_run(path))
  runs.check_same_tokens(path, runs.load_run_config(run_dir), tokenizer,
                         field)
  return runs.final_model(run_dir)


def define_flags() -> None:
  """The command's flags (defined when it runs, not when imported, so that
  other entry points can import this module)."""
  flags.DEFINE_string("model", None, "The run directory (or Hugging Face"
                      " checkpoint directory) to score.")
  flags.DEFINE_string("input", None, "JSONL of {\"text\"} or"
                      " {\"prompt\", \"completion\"} objects.")
  flags.DEFINE_string("output", None, "Where to write the JSONL.")
  flags.DEFINE_string("teacher", "", "A teacher run (or Hugging Face"
                      " checkpoint): adds its log-probs,"
                      " the MOPD signal and the KL.")
  flags.DEFINE_integer("batch_size", 32, "Lines scored at once.")


def main() -> None:
  f = flags.FLAGS
  for name in ("model", "input", "output"):
    if not f[name].value:
      raise UserError(f"--{name} is required")
  if f.batch_size < 1:
    raise UserError(f"--batch_size: {f.batch_size} is not > 0")
  output = os.path.abspath(f.output)
  if not os.path.isdir(os.path.dirname(output)):
    raise UserError(f"--output: no directory {os.path.dirname(output)}")
  if os.path.isdir(output):
    raise UserError(f"--output: {output} is a directory")
  tokenizer = tokenizer_lib.of_run(f.model)
  with contextlib.ExitStack() as stack:
    model = load(f.model, "--model", tokenizer, stack)
    teacher = (load(f.teacher, "--teacher", tokenizer, stack) if f.teacher
               else None)
    if teacher is not None and teacher[0].vocab_size != model[0].vocab_size:
      raise UserError(f"--teacher: {teacher[0].vocab_size} embeddings,"
                      f" --model {model[0].vocab_size}; their distributions"
                      " cannot be compared token by token")
    bounds = [m[0].max_positions for m in (model, teacher)
              if m is not None and m[0].max_positions]
    lines = parse(f.input, tokenizer, min(bounds, default=0))
    records = score_lines(lines, tokenizer, model, teacher, f.batch_size)
  write_text_atomic(output, "".join(json.dumps(r) + "\n" for r in records))
  print(f"scored {len(records)} lines -> {output}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
