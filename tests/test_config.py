"""Config validation: one ConfigError naming the field; the CLI turns it (and
flag errors, bad domains, unwritable workdirs) into one line and exit 2."""

import os

import pytest

from conftest import ROOT, load_config, train_cli
from mopd_jax import runs, stages
from mopd_jax.errors import ConfigError

SMOKE = os.path.join(ROOT, "configs", "pretrain.py") + ":smoke"


def _smoke():
  return load_config("pretrain", "smoke")


def test_defaults_validate_and_fill_missing_fields():
  cfg = _smoke()
  del cfg.eval
  full = stages.validate(cfg)
  assert full.eval.num_prompts == stages.defaults("pretrain").eval.num_prompts
  assert full.train.steps == 4  # the variant's value survives


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c.train.__setattr__("stepz", 3), "train.stepz"),
    (lambda c: c.__setattr__("modle", {}), "modle"),
    (lambda c: c.optim.__setattr__("learning_rate", -1.0),
     "optim.learning_rate"),
    (lambda c: c.train.__setattr__("steps", 0), "train.steps"),
    (lambda c: c.optim.__setattr__("decay_steps", -1), "optim.decay_steps"),
    (lambda c: c.train.__setattr__("max_consecutive_skips", 0),
     "train.max_consecutive_skips"),
    (lambda c: c.sampling.__setattr__("top_p", 1.5), "sampling.top_p"),
    (lambda c: c.mesh.__setattr__("cpu_devices", 0), "mesh.cpu_devices"),
    (lambda c: c.model.__setattr__("num_kv_heads", 3), "model.num_kv_heads"),
    (lambda c: c.model.__setattr__("head_dim", 15), "model.head_dim"),
    (lambda c: c.model.__setattr__("attention_impl", "flash"),
     "model.attention_impl"),
    (lambda c: c.model.__setattr__("attention_impl", "cudnn"),
     "model.attention_impl"),
    (lambda c: c.model.__setattr__("max_positions", -1),
     "model.max_positions"),
    (lambda c: c.data.__setattr__("weights", (1.0, 2.0)), "data.weights"),
    (lambda c: c.__setattr__("method", "magic"), "method"),
    (lambda c: c.__setattr__("seed", 2**70), "seed"),
    (lambda c: c.optim.__setattr__("learning_rate", float("inf")),
     "optim.learning_rate"),
    (lambda c: c.optim.__setattr__("learning_rate", 1e39),
     "optim.learning_rate"),
    (lambda c: c.data.__setattr__("test_examples", 100_000_000),
     "data.test_examples"),
])
def test_bad_field_is_named(mutate, field):
  cfg = _smoke()
  mutate(cfg)
  with pytest.raises(ConfigError) as err:
    stages.validate(cfg)
  assert str(err.value).startswith(field + ":")


def test_sequences_past_the_models_positions_are_refused():
  """A model that states the longest sequence it was trained on (an
  imported checkpoint's max_position_embeddings) refuses a run whose
  prompts and completions would run past it."""
  cfg = _smoke()
  cfg.model.max_positions = cfg.data.max_prompt_len + (
      cfg.sampling.max_new_tokens)
  runs.setup(stages.validate(cfg))  # exactly as long: fine
  cfg.model.max_positions -= 1
  with pytest.raises(ConfigError, match=(
      "^data.max_prompt_len \\+ sampling.max_new_tokens: "
      f"{cfg.model.max_positions + 1} positions, more than the model's"
      f" max_position_embeddings {cfg.model.max_positions}$")):
    runs.setup(stages.validate(cfg))


def test_wrong_type_is_named():
  import ml_collections
  cfg = ml_collections.ConfigDict(_smoke().to_dict())
  cfg.train = ml_collections.ConfigDict(dict(cfg.train.to_dict(), steps="ten"))
  with pytest.raises(ConfigError, match=r"^train\.steps: expected int"):
    stages.validate(cfg)


@pytest.mark.parametrize("override, needle", [
    ("--config.train.stepz=3", "train.stepz: unknown field"),
    ("--config.trainn.steps=3", "trainn: unknown field"),
    ("--config.train.steps=abc", "steps"),
    ("--config.train.steps=0", "train.steps"),
    ("--config.data.domains=('add','poetry')", "poetry"),
    ("--config.seed=99999999999999999999", "seed: must be in [0, 2^31)"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, override, needle):
  result = train_cli(f"--config={SMOKE}", f"--workdir={tmp_path / 'w'}",
                     override, f"--config.data.data_dir={tmp_path / 'd'}")
  assert result.returncode == 2, result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and needle in lines[0], result.stderr
  assert "Traceback" not in result.stderr


def test_cli_missing_config_file(tmp_path):
  result = train_cli(f"--config={tmp_path / 'nope.py'}",
                     f"--workdir={tmp_path}")
  assert result.returncode == 2 and "nope.py" in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1


def test_cli_unknown_config_variant(tmp_path):
  result = train_cli(f"--config={ROOT}/configs/mopd.py:opne",
                     f"--workdir={tmp_path}")
  assert result.returncode == 2
  assert result.stderr.strip() == (
      f"error: flag --config={ROOT}/configs/mopd.py:opne: ValueError: unknown"
      " variant 'opne' of configs/mopd.py (known: open, smoke, hf)")


def test_cli_empty_workdir_and_config_without_get_config(tmp_path):
  result = train_cli(f"--config={SMOKE}", "--workdir=")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      "error: workdir: empty; name the run directory")
  bare = tmp_path / "bare.py"
  bare.write_text("X = 1\n")
  result = train_cli(f"--config={bare}", f"--workdir={tmp_path / 'w'}")
  assert result.returncode == 2
  assert result.stderr.strip() == ("error: --config: the config file defines"
                                   " no get_config(variant) function")


def test_cli_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  result = train_cli(f"--config={SMOKE}", f"--workdir={blocker / 'run'}")
  assert result.returncode == 2
  assert "workdir" in result.stderr and "Traceback" not in result.stderr
  assert blocker.read_text() == "not a directory"


def test_cli_malformed_eval_jsonl_names_file_and_line(tmp_path, data_dir):
  path = tmp_path / "eval.jsonl"
  path.write_text('{"prompt": "add 1+2=", "answer": "3", "domain": "add"}\n'
                  '{"prompt": "add 1+2=", "answer": 3, "domain": "add"}\n')
  result = train_cli(f"--config={SMOKE}", f"--workdir={tmp_path / 'w'}",
                     f"--config.data.data_dir={data_dir}",
                     f"--config.data.eval_jsonl={path}")
  assert result.returncode == 2
  assert f"{path}:2: field 'answer'" in result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c.rl.__setattr__("minibatches", 3), "rl.minibatches"),
    (lambda c: c.rl.__setattr__("advantage", "ppo"), "rl.advantage"),
    (lambda c: c.rl.__setattr__("group_size", 1), "rl.group_size"),
    (lambda c: c.rl.__setattr__("dual_clip", 0.5), "rl.dual_clip"),
    (lambda c: c.rl.update(advantage="passk", pass_k=9), "rl.pass_k"),
    (lambda c: c.rl.__setattr__("entropy_coef", -0.1), "rl.entropy_coef"),
    (lambda c: c.sampling.__setattr__("top_k", 5), "sampling.top_k"),
    (lambda c: c.__setattr__("domain", "poetry"), "domain"),
    (lambda c: c.eval.__setattr__("domains", ("add", "x")), "eval.domains"),
])
def test_rl_fields_are_checked(mutate, field):
  cfg = stages.defaults("grpo")
  cfg.init = "runs/base"
  mutate(cfg)
  with pytest.raises(ConfigError) as err:
    stages.validate(cfg)
  assert str(err.value).startswith(field + ":")


def test_mix_rl_floor_and_weights_are_checked():
  cfg = stages.defaults("mix_rl")
  cfg.init = "runs/base"
  cfg.mixture.floor = 0.3
  with pytest.raises(ConfigError, match=r"^mixture\.floor:"):
    stages.validate(cfg)
  cfg.mixture.floor = 0.05
  cfg.data.weights = (1.0, 1.0)
  with pytest.raises(ConfigError, match=r"^data\.weights:"):
    stages.validate(cfg)


def test_open_mopd_variant_validates_and_power_is_checked():
  cfg = load_config("mopd", "open")
  cfg.update(teachers="runs/expert_{domain}", init="runs/base")
  om = stages.validate(cfg).open_mopd
  assert om.token_share and om.gap_budget and om.reward_refresh
  assert om.token_share_power == 0.5 and om.gap_statistic == "sequence_kl"
  cfg.open_mopd.token_share_power = -1.0
  with pytest.raises(ConfigError, match=r"^open_mopd\.token_share_power:"):
    stages.validate(cfg)


@pytest.mark.parametrize("name", ["grpo", "mix_rl", "mopd", "merge", "study"])
def test_hf_variants_validate_with_the_real_model_settings(name):
  """Every ``:hf`` variant is a valid config with bfloat16, remat, blocked
  attention (where the method computes with its model), FSDP over every
  device and, for the study, every step run as its ``:hf`` variant."""
  config = load_config(name, "hf")
  if name != "study":  # the checkpoint comes from a flag
    config.init = "runs/qwen3"
  if name in ("merge", "mopd"):
    config["experts" if name == "merge" else "teachers"] = "runs/e_{domain}"
  config = stages.validate(config)
  assert (config.mesh.data, config.mesh.fsdp) == (1, -1)
  if name == "study":
    assert config.variant == "hf"
    return
  assert (config.model.dtype, config.model.remat,
          config.model.attention_chunk) == ("bfloat16", True, 512)
  assert config.data.max_prompt_len == 512
  assert config.sampling.max_new_tokens == 1024
  if name != "merge":
    assert config.optim.learning_rate == 1e-6
    rl = config.rl
    assert rl.prompts_per_step * rl.group_size // rl.minibatches == 32


# mergekit's parameters as configs/merge.py and the README name them.
MERGE_FLAGS = {"method": ("ties", "ties"), "lambda": ("0.8", 0.8),
               "density": ("0.5", 0.5), "gamma": ("0.02", 0.02),
               "t": ("0.3", 0.3), "weights": ("(1.0,2.0)", (1.0, 2.0)),
               "normalize": ("off", "off"), "tolerance": ("0.1", 0.1),
               "rescale": ("False", False), "geometry": ("False", False)}


def test_every_merge_parameter_is_settable_from_the_command_line():
  """``--config.merge.<name>=...`` for each, ``lambda`` (a Python keyword)
  included, parsed as the entry points parse it (in a fresh process: absl
  flags are global)."""
  import json
  import subprocess
  import sys
  script = (
      "import json, sys\n"
      "from absl import flags\n"
      "from ml_collections import config_flags\n"
      "from mopd_jax import cli\n"
      "cli._split_dotted_paths()\n"
      "config_flags.DEFINE_config_file('config')\n"
      "flags.FLAGS(sys.argv)\n"
      "print(json.dumps(flags.FLAGS.config.merge.to_dict()))\n")
  result = subprocess.run(
      [sys.executable, "-c", script, f"--config={ROOT}/configs/merge.py"]
      + [f"--config.merge.{k}={text}" for k, (text, _) in MERGE_FLAGS.items()],
      capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  merge = json.loads(result.stdout.strip().splitlines()[-1])
  for key, (_, want) in MERGE_FLAGS.items():
    got = merge[key]
    assert (tuple(got) if isinstance(want, tuple) else got) == want, key
  assert set(MERGE_FLAGS) >= set(merge) - {
      "overrides", "sweep", "sweep_lambdas", "sweep_densities",
      "sweep_prompts"}
