"""Dataset configs and the registry: every config builds sources whose batches follow the spec."""
import importlib.util
import os

import numpy as np
import pytest
from data_fixtures import synth_data  # noqa: F401

from gem_jax.data import registry
from gem_jax.data.spec import validate_batch

CONFIGS = ("criteo", "avazu", "movielens", "alimama", "adult")
ROOT = os.path.join(os.path.dirname(__file__), "..")
SYNTH = {   # config: the data_fixtures files for (train, eval)
    "criteo": ("train", "dev"), "avazu": ("train", "dev"), "movielens": ("ratings", "ratings"),
    "alimama": ("train", "train"), "adult": ("train", "test")}


def load_config(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def check_config(c, name):
  train, ev = registry.make_sources(c.data)
  assert train.shuffle_buffer == c.data.shuffle_buffer and ev.shuffle_buffer == 0
  b = next(train.batches(c.data.batch_size, seed=c.seed))
  validate_batch(train.spec, b, name)
  validate_batch(ev.spec, next(ev.batches(c.data.eval_batch_size, repeat=False)), name)
  assert b["label_mask"].sum() == c.data.batch_size * len(train.spec.tasks)
  assert c.data.batch_size % 8 == 0 and c.data.eval_batch_size % 8 == 0
  for f, shared in getattr(train, "shared_vocab", {}).items():
    assert train.spec.feature(shared).vocab == train.spec.feature(f).vocab


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_sources(name, synth_data):  # noqa: F811
  c = load_config(name)
  assert c.data.kind == name and c.data.bad_row_limit == 0.01
  files = getattr(synth_data, name)
  c.data.train, c.data.eval = (files[k] for k in SYNTH[name])      # paths overridable
  if name == "movielens":
    c.data.movies = files["movies"]
  check_config(c, name)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_defaults_name_the_real_files(name, real_data_dir):
  c = load_config(name)
  for k in ("train", "eval"):                       # the default names, in $GEM_JAX_DATA
    c.data[k] = os.path.join(real_data_dir, os.path.basename(c.data[k]))
  if name == "movielens":
    c.data.movies = os.path.join(real_data_dir, os.path.basename(c.data.movies))
  check_config(c, name)


def test_path_override_and_missing_file(tmp_path, synth_data):  # noqa: F811
  c = load_config("criteo")
  c.data.train, c.data.eval = synth_data.criteo["train"], str(tmp_path / "missing.tsv")
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


def test_docs_example_source_runs(tmp_path):
  """The `ClickLog` example of docs/data.md works as printed."""
  with open(os.path.join(ROOT, "docs", "data.md")) as f:
    doc = f.read()
  code = doc.split("```python\n", 1)[1].split("```", 1)[0]
  scope = {}
  exec(compile(code, "docs/data.md", "exec"), scope)  # noqa: S102
  p = tmp_path / "log.csv"
  p.write_bytes(b"1,ab12,7,2.5\n0,ff,8,0\n1,zz,9,1\n")
  c = load_config("criteo")
  c.data.kind, c.data.train, c.data.eval = "clicklog", str(p), str(p)
  c.data.bad_row_limit = 0.5                  # 1 bad row of 3 is fine here
  _, ev = registry.make_sources(c.data)
  b = next(ev.batches(8, repeat=False))
  assert b["label_mask"][:, 0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]   # row 3 bad (zz), rest padding
  assert b["ids"]["ad"][:2, 0].tolist() == [0xab12, 0xff]
  assert b["ids"]["user"][:2, 0].tolist() == [7, 8]
  assert abs(b["dense"][0, 0] - np.log1p(2.5)) < 1e-6
