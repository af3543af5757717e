"""Run configs load and validate; config errors stop with a clear message before
anything is compiled."""
import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from gem_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("tiny", "small", "medium", "large")


def load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


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


@pytest.mark.parametrize("name", NAMES)
def test_config_fields_and_docstring(name):
  c = load(name)
  for block, fields in {
      "data": ("kind", "batch_size", "eval_batch_size", "eval_examples"),
      "model": ("name", "preset", "dtype", "fp8", "remat"),
      "embedding": ("dim", "optimizer", "lr", "sharding", "id_policy", "memory_budget_gb"),
      "optim": ("name", "lr", "warmup_steps", "decay", "weight_decay", "clip_norm"),
      "train": ("steps", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep",
                "best_metric", "grad_accum", "profile_steps", "compile_cache")}.items():
    for f in fields:
      assert f in c[block], f"{name}: {block}.{f}"
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert f"configs/{name}.py" in mod.__doc__  # the command that runs it
  assert "dense parameters" in mod.__doc__ and "FLOPs per example" in mod.__doc__


@pytest.mark.parametrize("name", ("tiny", "small"))
def test_cpu_configs_validate_on_8_devices(name):
  assert loop.check_config(load(name), 8) in ((2, 4),)


def test_large_mesh_needs_more_devices_than_one_node():
  c = load("large")
  assert loop.check_config(c, 16) == (2, 8)
  c.mesh = (4, 8)
  with pytest.raises(loop.ConfigError, match=r"needs 32 devices but only 8"):
    loop.check_config(c, 8)


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
])
def test_config_errors_before_compiling(compiles, over, message):
  c = _tiny(**{k: v for k, v in over.items() if "." in k})
  if "mesh" in over:
    c.mesh = over["mesh"]
  before = compiles.n
  with pytest.raises(loop.ConfigError, match=message):
    loop.setup(c)
  assert compiles.n == before


def test_missing_data_is_a_config_error(compiles, tmp_path):
  c = load("tiny")
  c.data.kind = "criteo"
  c.data.train = str(tmp_path / "nope" / "train.tsv")
  c.data.eval = str(tmp_path / "nope" / "eval.tsv")
  before = compiles.n
  with pytest.raises(loop.ConfigError, match=r"config.data \(criteo\).*nope"):
    loop.setup(c)
  assert compiles.n == before


def test_unknown_field_on_the_command_line():
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
       os.path.join(ROOT, "configs", "tiny.py"), "--workdir", "/nonexistent/never_created",
       "--config.train.stepz=4"],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0
  err = proc.stderr.strip().splitlines()[-1]
  assert err.startswith("config error: unknown config field"), proc.stderr[-2000:]
  assert "train.stepz" in err and "steps" in err
  assert "Traceback" not in proc.stderr
  assert not os.path.exists("/nonexistent/never_created")
