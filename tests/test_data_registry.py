"""Dataset configs and the registry: every config builds sources whose batches follow the spec."""
import importlib.util
import os

import pytest

from gem_jax.data import registry
from gem_jax.data.spec import validate_batch

CONFIGS = ("criteo", "avazu", "movielens", "alimama", "adult")
ROOT = os.path.join(os.path.dirname(__file__), "..")


def load_config(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_sources(name, shared_data_dir):
  c = load_config(name)
  assert c.data.kind == name and c.data.bad_row_limit == 0.01
  for k in ("train", "eval"):                       # paths overridable, here to $GEM_JAX_DATA
    c.data[k] = os.path.join(shared_data_dir, os.path.basename(c.data[k]))
  if name == "movielens":
    c.data.movies = os.path.join(shared_data_dir, os.path.basename(c.data.movies))
  train, ev = registry.make_sources(c.data)
  assert train.shuffle_buffer == c.data.shuffle_buffer and ev.shuffle_buffer == 0
  b = next(train.batches(c.data.batch_size, seed=c.seed))
  validate_batch(train.spec, b, name)
  validate_batch(ev.spec, next(ev.batches(c.data.eval_batch_size, repeat=False)), name)
  assert b["label_mask"].sum() == c.data.batch_size * len(train.spec.tasks)
  assert c.data.batch_size % 8 == 0 and c.data.eval_batch_size % 8 == 0
  for f, shared in getattr(train, "shared_vocab", {}).items():
    assert train.spec.feature(shared).vocab == train.spec.feature(f).vocab


def test_path_override_and_missing_file(tmp_path):
  c = load_config("criteo")
  c.data.eval = str(tmp_path / "missing.tsv")
  with pytest.raises(FileNotFoundError, match="missing.tsv"):
    registry.make_sources(c.data)


def test_unknown_kind_and_custom_kind():
  c = load_config("adult")
  c.data.kind = "nope"
  with pytest.raises(ValueError, match="unknown data.kind 'nope'"):
    registry.make_sources(c.data)
  registry.register("mine", lambda cfg, split: (split, cfg.kind))
  c.data.kind = "mine"
  assert registry.make_sources(c.data) == (("train", "mine"), ("eval", "mine"))
  assert "mine" in registry.kinds()
