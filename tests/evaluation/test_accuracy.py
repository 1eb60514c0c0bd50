import jax

from mopd_jax.data.domains import Example
from mopd_jax.evaluation import accuracy
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.tokenizer import CharTokenizer
from mopd_jax.rollout.sampler import SamplingConfig

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, embed_dim=16, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)


def test_generate_batches_and_pads_the_last_batch():
  params = decoder.init_params(CFG, jax.random.key(0))
  prompts = ["add 1+2=", "rev ab:", "sort ba:"]
  sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
  a, len_a = accuracy.generate(params, CFG, TOK, prompts, sampling,
                               jax.random.key(0), 2, 12)
  b, len_b = accuracy.generate(params, CFG, TOK, prompts[2:], sampling,
                               jax.random.key(0), 2, 12)
  assert len(a) == len(len_a) == 3
  assert (a[2], len_a[2]) == (b[0], len_b[0])  # greedy: same prompt, same text


def test_evaluate_uniform_model_is_always_wrong():
  params = decoder.init_params(CFG, jax.random.key(0))
  params["final_norm"] = params["final_norm"] * 0  # uniform logits -> PAD
  exs = {"instruct": [Example("first 2 of abc:", "ab", "instruct")] * 3,
         "add": [Example("add 1+2=", "3", "add")]}
  sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
  out = accuracy.evaluate(params, CFG, TOK, exs, sampling, jax.random.key(0),
                          4, 16)
  correct = out["instruct"].pop("correct")
  assert out["instruct"] == dict(accuracy=0.0, reward=0.0, length=4.0)
  assert correct.tolist() == [0, 0, 0] and len(out["add"]["correct"]) == 1
  assert set(out) == {"instruct", "add"}


def test_grade_with_the_domain_verifier():
  exs = [Example("add 1+2=", "3", "add"), Example("add 5+5=", "10", "add")]
  out = accuracy.grade("add", ["3", "11"], exs, [2, 3])
  assert out.pop("correct").tolist() == [1, 0]
  assert out == dict(accuracy=0.5, reward=0.5, length=2.5)
  out = accuracy.grade("chain", ["1+2=3;#3"],
                       [Example("sum 1 2:", "1+2=3;#3", "chain")], [9])
  assert out["accuracy"] == 1.0


def test_format_table():
  res = {"sampled": {"add": dict(accuracy=0.25, reward=0.25, length=3.0)},
         "greedy": {"add": dict(accuracy=0.5, reward=0.5, length=2.0)}}
  text = accuracy.format_table(res)
  lines = text.splitlines()
  assert lines[0].split() == ["domain", "sampled", "acc", "greedy", "acc",
                              "sampled", "len"]
  assert lines[2].split() == ["add", "25.0%", "50.0%", "3.0"]
  assert len(lines) == 3


def test_a_few_prompts_cost_a_few_rows(monkeypatch):
  """3 prompts of a batch size of 128: 4 rows (the next power of two),
  as wide as the longest needs (16 of the 64 allowed)."""
  from mopd_jax.rollout import sampler
  params = decoder.init_params(CFG, jax.random.key(0))
  shapes, sample = [], sampler.sample

  def recorded(params, cfg, prompt, mask, key, sampling):
    shapes.append((prompt.shape, int(mask.sum())))
    return sample(params, cfg, prompt, mask, key, sampling)

  monkeypatch.setattr(sampler, "sample", recorded)
  prompts = ["add 1+2=", "rev ab:", "sort ba:"]
  accuracy.generate(params, CFG, TOK, prompts,
                    SamplingConfig(max_new_tokens=3, temperature=0.0),
                    jax.random.key(0), 128, 64)
  assert shapes == [((4, 16), sum(len(p) + 1 for p in prompts))]
