"""Run configs load and validate; config errors stop with a clear message before
anything is compiled.

The schema: configs/base.py declares every field (`get_config()` for trainer runs,
`student_config()` for knowledge-transfer students); each run config starts from
it and may set only declared fields. tests/config_reference.json freezes every
config's values as they were before the schema (commit a67030d, generated once
from `git show a67030d:configs/NAME.py`, paths as <data>/... and <configs>/...);
a field a config gained from the schema must hold base's default, which is the
default the code used when the field was absent. One deliberate change since: the
dataset configs (criteo, avazu, adult, alimama, movielens) train one pass by default
(train.steps=0, train.epochs=1, best checkpoint and early stopping by eval log loss;
criteo and avazu with batches of 128), their reference values updated with them.
Configs added since (long_seq, long_seq_gpu, gem_xl) are recorded as added: their fields that
differ from base's defaults.
"""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from gem_jax.bench import runner
from gem_jax.models import config as model_config_lib
from gem_jax.train import setup as setup_lib
from gem_jax.train import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
NAMES = ("tiny", "small", "medium", "large")
ALL = tuple(sorted(f[:-3] for f in os.listdir(CONFIGS) if f.endswith(".py") and f != "base.py"))
with open(os.path.join(ROOT, "tests", "config_reference.json"), encoding="utf-8") as _f:
  REFERENCE = json.load(_f)
OPEN = "model.overrides."  # the one open block: model-config fields, checked by the model


def module(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIGS, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def load(name):
  return module(name).get_config()


def flat(d, prefix=""):
  """{'data.batch_size': 256, ...}; an empty block is one entry {}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def values(config):
  """Flat JSON values of a config, its paths as in tests/config_reference.json."""
  data = module("base").DATA
  out = {}
  for k, v in flat(config.to_dict()).items():
    if isinstance(v, str):
      v = v.replace(data, "<data>").replace(CONFIGS, "<configs>")
    out[k] = json.loads(json.dumps(v))
  return out


def schema_of(config):
  base = module("base")
  return base.student_config() if "transfer" in config else base.get_config()


def test_reference_covers_every_config():
  assert sorted(REFERENCE) == list(ALL)


@pytest.mark.parametrize("name", ALL)
def test_config_values_unchanged(name):
  c = load(name)
  got, ref, default = values(c), REFERENCE[name], values(schema_of(c))
  assert {k: got.get(k, "<absent>") for k in ref} == ref
  added = {k: v for k, v in got.items() if k not in ref}
  assert added == {k: default[k] for k in added}, "a newly declared field must hold base's default"


@pytest.mark.parametrize("name", ALL)
def test_config_declares_only_schema_fields(name):
  c = load(name)
  fields = {k for k in flat(c.to_dict()) if not k.startswith(OPEN)} - {OPEN[:-1]}
  schema = set(flat(schema_of(c).to_dict())) - {OPEN[:-1]}
  assert fields - schema == set(), f"{name}: declare these in configs/base.py"
  assert schema - fields == set()  # starts from base, deletes nothing
  known = {f.name for f in dataclasses.fields(model_config_lib.GEMConfig)}
  assert set(c.model.overrides) <= known, f"{name}: model.overrides outside the model config"


@pytest.mark.parametrize("name", ALL)
def test_runner_loads_like_importlib(name):
  assert runner.load_config(name).to_dict() == load(name).to_dict()


@pytest.mark.parametrize("name", ALL)
def test_docstring_keeps_what_and_how_not_run_logs(name):
  doc = module(name).__doc__
  assert doc.startswith(f"{name}: ")
  assert f"configs/{name}.py" in doc or f"--config {name}" in doc  # the command that runs it
  assert not re.search(r"examples/s|load average|Measured|\d s per step", doc), \
      "run logs go to docs/PERFORMANCE.md or docs/RESULTS.md"


@pytest.mark.parametrize("name", NAMES)
def test_sizes_in_docstring(name):
  doc = module(name).__doc__
  assert "dense parameters" in doc and "FLOPs per example" in doc


def _flag_value(v):
  """A command-line value of v's type that differs from v."""
  if isinstance(v, bool):
    return str(not v), not v
  if isinstance(v, int):
    return str(v + 1), v + 1
  if isinstance(v, float):
    return repr(v + 0.5), v + 0.5
  if isinstance(v, str):
    return "x" + v, "x" + v
  if isinstance(v, tuple):
    new = (2, -1) if v == (1, -1) else (8,) if v == (16,) else ("a",)
    return repr(new), new
  assert v is None, v  # placeholder(int)
  return "5", 5


def _parse(name, *argv):
  """`--config=configs/NAME.py *argv` through absl config_flags, locked like scripts/train.py
  (config_flags reads the overrides from sys.argv)."""
  argv = ["train.py", f"--config={os.path.join(CONFIGS, name + '.py')}", *argv]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True)
  with mock.patch.object(sys, "argv", argv):
    fv(argv)
  return fv.config


@pytest.mark.parametrize("name", ("tiny", "student_planted"))
def test_every_field_overridable_from_the_command_line(name):
  """As scripts/train.py parses them (absl config_flags, locked): each declared field."""
  c = load(name)
  for key, v in flat(c.to_dict()).items():
    if key.startswith(OPEN) or key == OPEN[:-1]:
      continue
    v = c
    for p in key.split("."):
      v = v[p]
    text, want = _flag_value(v)
    got = _parse(name, f"--config.{key}={text}")
    for p in key.split("."):
      got = got[p]
    assert got == want, key


def test_unknown_field_rejected_by_the_flag_parser():
  assert _parse("tiny", "--config.train.stop_at=2").train.stop_at == 2
  with pytest.raises((flags.Error, AttributeError, KeyError), match="stepz"):
    _parse("tiny", "--config.train.stepz=1")


class CompileCounter:
  """Counts XLA backend compilations while active."""

  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, *_, **__):
    if "backend_compile" in event:
      self.n += 1


@pytest.fixture(scope="module")
def compiles():
  return CompileCounter()


@pytest.mark.parametrize("name", ("tiny", "small", "long_seq"))
def test_cpu_configs_validate_on_8_devices(name):
  assert validate.check_config(load(name), 8) in ((2, 4), (1, 8))


@pytest.mark.parametrize("name,devices", [("long_seq", 8), ("long_seq_gpu", 1)])
def test_long_seq_configs(name, devices):
  """long_history data, its sources build, packing sized for the stream plus the CLS slots
  (the GPU config validates on its one GPU)."""
  from gem_jax.data import registry  # pylint: disable=import-outside-toplevel
  c = load(name)
  assert validate.check_config(c, devices) == (1, devices)
  train, ev = registry.make_sources(c.data)
  (stream,) = train.spec.sequences
  assert stream.max_len == c.data.max_len and ev.num_examples == c.data.eval_examples
  model = model_config_lib.get_config(c.model.preset, **c.model.overrides)
  assert model.seq_pack_tokens == stream.max_len + model.num_cls
  rows = c.data.batch_size // devices                  # histories per batch shard
  assert 2 <= model.seq_pack_rows < rows or rows <= 2
  assert model.seq_pack_rows * model.seq_pack_tokens >= 1.5 * rows * (
      model.num_cls + np.minimum(train.gen.lengths(20_000, np.random.default_rng(0)),
                                 stream.max_len).mean())
  if name == "long_seq_gpu":
    assert "one GPU" in module(name).__doc__ and model.dtype == "bfloat16"
    assert (model.d_model, stream.max_len, model.attn_impl) == (256, 8192, "auto")


def test_large_mesh_needs_more_devices_than_one_node():
  c = load("large")
  assert validate.check_config(c, 16) == (2, 8)
  c.mesh = (4, 8)
  with pytest.raises(validate.ConfigError, match=r"needs 32 devices but only 8"):
    validate.check_config(c, 8)


def _tiny(**over):
  c = load("tiny")
  for path, v in over.items():
    block, field = path.split(".")
    c[block][field] = v
  return c


@pytest.mark.parametrize("over,message", [
    ({"mesh": (4, 4)}, r"config.mesh=\(4, 4\).*needs 16 devices but only 8"),
    ({"data.batch_size": 60}, r"batch_size=60 must be divisible by the 8 devices"),
    ({"train.grad_accum": 3}, r"grad_accum=3 must divide the per-device batch 8"),
    ({"embedding.memory_budget_gb": 1e-6}, r"embedding plan: .*(user|ad|category)"),
    ({"model.preset": "huge"}, r"config.model .*huge"),
    ({"model.name": "bert"}, r"config.model.name='bert'"),
    ({"train.steps": 0}, r"config.train.steps=0 and config.train.epochs=0: set"),
    ({"train.steps": -1}, r"config.train.steps=-1 must be >= 1"),
    ({"train.epochs": -0.5}, r"config.train.epochs=-0.5 must be"),
    ({"train.early_stop_patience": -1}, r"early_stop_patience=-1 must be >= 0"),
    ({"train.best_metric": "eval_calibration"}, r"best_metric='eval_calibration'"),
])
def test_config_errors_before_compiling(compiles, over, message):
  c = _tiny(**{k: v for k, v in over.items() if "." in k})
  if "mesh" in over:
    c.mesh = over["mesh"]
  before = compiles.n
  with pytest.raises(validate.ConfigError, match=message):
    setup_lib.setup(c)
  assert compiles.n == before


DATASETS = ("criteo", "avazu", "adult", "alimama", "movielens")


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_configs_train_one_pass_with_early_stopping(name):
  t = load(name).train
  assert (t.steps, t.epochs) == (0, 1.0)          # one pass; --config.train.steps=N wins
  assert t.best_metric == "eval_logloss" and t.early_stop_patience > 0
  assert t.checkpoint_every == t.eval_every      # every eval can become the best checkpoint
  assert "one pass" in module(name).__doc__


@pytest.mark.parametrize("name", [n for n in ALL if n not in DATASETS])
def test_other_configs_keep_their_step_counts(name):
  t = load(name).train
  assert t.steps > 0
  if "epochs" in t:  # the trainer schema (a student's train block has neither field)
    assert t.epochs == 0 and t.early_stop_patience == 0


def test_missing_data_is_a_config_error(compiles, tmp_path):
  c = load("tiny")
  c.data.kind = "criteo"
  c.data.train = str(tmp_path / "nope" / "train.tsv")
  c.data.eval = str(tmp_path / "nope" / "eval.tsv")
  before = compiles.n
  with pytest.raises(validate.ConfigError, match=r"config.data \(criteo\).*nope"):
    setup_lib.setup(c)
  assert compiles.n == before


def _train_cli(*flags):
  """scripts/train.py on configs/tiny.py with `flags` (a workdir that must never appear)."""
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
       os.path.join(ROOT, "configs", "tiny.py"), "--workdir", "/nonexistent/never_created",
       *flags],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_unknown_field_on_the_command_line():
  proc = _train_cli("--config.train.stepz=4")
  assert proc.returncode != 0
  err = proc.stderr.strip().splitlines()[-1]
  assert err.startswith("config error: unknown config field"), proc.stderr[-2000:]
  assert "train.stepz" in err and "steps" in err
  assert "Traceback" not in proc.stderr
  assert not os.path.exists("/nonexistent/never_created")


def test_bench_overrides_are_checked_against_the_schema():
  c = runner.load_config("tiny", {"train.stop_at": 2, "data.batch_size": 128})
  assert c.train.stop_at == 2 and c.data.batch_size == 128
  with pytest.raises(ValueError, match=r"config tiny: unknown field 'train\.stepz'"):
    runner.load_config("tiny", {"train.stepz": 1})


def test_model_overrides_on_the_command_line():
  """`--config.model.overrides.FIELD=VALUE` reaches the model config: literals parsed,
  an unknown model field is the one-line config error naming it."""
  from gem_jax.train.loop import split_model_overrides  # pylint: disable=import-outside-toplevel
  rest, over = split_model_overrides(
      ["train.py", "--config.model.overrides.d_model=32", "--config.train.steps=2",
       "--config.model.overrides.attn_mask=causal", "--config.model.overrides.pyramid=(1.0,)"])
  assert rest == ["train.py", "--config.train.steps=2"]
  assert over == {"d_model": 32, "attn_mask": "causal", "pyramid": (1.0,)}
  proc = _train_cli("--config.model.overrides.d_modle=32")
  assert proc.returncode != 0
  err = proc.stderr.strip().splitlines()[-1]
  assert err.startswith("config error: config.model"), proc.stderr[-2000:]
  assert "d_modle" in err and "Traceback" not in proc.stderr
