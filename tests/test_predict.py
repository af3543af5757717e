"""Batch scoring (scripts/predict.py, gem_jax/train/predict.py) of a tiny DLRM trained on
the Criteo-format files of tests/data_fixtures.py.

One checkpoint (scripts/train.py, 12 steps) and one restored model (8 devices, batch 64)
serve every test: predictions equal the eval pass (their log loss is evaluate's), text
and converted-dataset inputs give the same rows, bad rows keep their row number and
reason under every `bad_rows` rule, an interrupted run resumes to the uninterrupted
output, the script on 1 device writes the 8-device predictions, and a checkpoint of
another model or config is refused naming the field.
"""
import json
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from data_fixtures import synth_data  # noqa: F401

from gem_jax.bench.runner import load_config
from gem_jax.data import convert
from gem_jax.data.badrows import BadRowLimitError
from gem_jax.train import evaluate
from gem_jax.train import predict
from gem_jax.train import setup as setup_lib
from gem_jax.train.validate import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, BATCH = 12, 64


def _overrides(fx) -> list[str]:
  d = os.path.dirname(fx["train"])
  return [f"--config.data.train={d}/train.tsv", f"--config.data.eval={d}/dev.tsv",
          "--config.model.name=dlrm", "--config.model.preset=tiny"]


def _config(fx, **changes):
  """configs/criteo.py as the fixture trained it, with {'block.field': value} changes."""
  d = os.path.dirname(fx["train"])
  return load_config("criteo", {
      "data.train": f"{d}/train.tsv", "data.eval": f"{d}/dev.tsv", "model.name": "dlrm",
      "model.preset": "tiny", "train.steps": STEPS, "train.eval_every": STEPS,
      "train.checkpoint_every": STEPS, **changes})


@pytest.fixture(scope="module")
def run(tmp_path_factory, synth_data):  # noqa: F811
  """(fixtures, workdir, config, restored model): a trained tiny DLRM, restored once."""
  fx = synth_data.criteo
  workdir = tmp_path_factory.mktemp("predict") / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
         os.path.join(ROOT, "configs", "criteo.py"), "--workdir", str(workdir),
         *_overrides(fx), f"--config.train.steps={STEPS}", f"--config.train.eval_every={STEPS}",
         f"--config.train.checkpoint_every={STEPS}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = _config(fx)
  return fx, str(workdir), config, predict.restore_model(config, str(workdir), BATCH)


def _predict(run, source, out, **kw):
  _, _, config, model = run
  return predict.predict(model, source, str(out), seed=config.seed, **kw)


def _dev_source(run):
  return run[3].setup.eval_src


def _logloss(p, y):
  p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
  return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def test_predictions_are_the_eval_pass(run, tmp_path):
  fx, workdir, config, _ = run
  index = _predict(run, _dev_source(run), tmp_path / "out", rows_per_part=128, trunk=True)
  got = predict.read_predictions(str(tmp_path / "out"))
  n = len(fx["dev_rows"])
  assert index["rows"] == index["written"] == n and index["bad"] == 0
  assert list(got["row"]) == list(range(n))                      # input order, no padding
  assert got["key"] == [f"{fx['dev']}:{i + 1}" for i in range(n)]
  assert got["trunk"].shape[0] == n and np.isfinite(got["trunk"]).all()
  labels = np.asarray([r.label for r in fx["dev_rows"]], np.float64)
  ev = evaluate.evaluate_checkpoint(config, workdir)
  assert ev["step"] == STEPS
  assert abs(_logloss(got["p_click"], labels) - ev["eval_logloss/click"]) < 2e-6


def test_text_and_dataset_inputs_agree(run, tmp_path):
  fx, _, config, _ = run
  conv = _config(fx, **{"data.train": fx["dev"]})
  convert.convert_config(conv.data, str(tmp_path / "ds"), splits=("eval",), row_group_rows=96,
                         rows_per_file=192)
  s = setup_lib.setup(predict.scoring_config(config, BATCH, str(tmp_path / "ds" / "eval")))
  assert type(s.eval_src).__name__ == "ParquetSource"
  _predict(run, s.eval_src, tmp_path / "ds_out", rows_per_part=64)
  _predict(run, _dev_source(run), tmp_path / "txt_out", rows_per_part=192)
  a = predict.read_predictions(str(tmp_path / "ds_out"))
  b = predict.read_predictions(str(tmp_path / "txt_out"))
  assert "key" not in a and np.array_equal(a["row"], b["row"])
  np.testing.assert_array_equal(a["p_click"], b["p_click"])


def test_key_column_carries_the_raw_field(run, tmp_path):
  fx, _, config, _ = run
  _predict(run, _dev_source(run), tmp_path / "keyed", rows_per_part=128, key_column="C1")
  got = predict.read_predictions(str(tmp_path / "keyed"))
  assert list(got)[:4] == ["row", "key", "error", "C1"]
  assert got["C1"] == [r.cats[0] or "" for r in fx["dev_rows"]]
  _predict(run, _dev_source(run), tmp_path / "plain", rows_per_part=128)
  plain = predict.read_predictions(str(tmp_path / "plain"))
  np.testing.assert_array_equal(got["p_click"], plain["p_click"])
  with pytest.raises(ConfigError, match=r"key column 'user': .*the columns \['label', 'I1'"):
    _predict(run, _dev_source(run), tmp_path / "x", key_column="user")
  with pytest.raises(ConfigError, match="clashes"):
    _predict(run, _dev_source(run), tmp_path / "y", key_column="p_click")
  conv = _config(fx, **{"data.train": fx["dev"]})
  convert.convert_config(conv.data, str(tmp_path / "ds"), splits=("eval",))
  s = setup_lib.setup(predict.scoring_config(config, BATCH, str(tmp_path / "ds" / "eval")))
  with pytest.raises(ConfigError, match="keyed by `row`"):
    _predict(run, s.eval_src, tmp_path / "z", key_column="C1")


def test_bad_rows_keep_their_place(run, tmp_path):
  fx, _, config, _ = run
  bad = fx["bad"]
  s = setup_lib.setup(predict.scoring_config(config, BATCH, bad.path))
  with pytest.raises(BadRowLimitError):          # 12 of 212 rows: over the default 1 %
    _predict(run, s.eval_src, tmp_path / "limit")
  out = {}
  for mode in predict.BAD_ROWS:
    index = _predict(run, s.eval_src, tmp_path / mode, bad_rows=mode, bad_row_limit=0.1,
                     rows_per_part=64)
    assert index["rows"] == 212 and index["bad"] == len(bad.lines) == 12
    out[mode] = predict.read_predictions(str(tmp_path / mode))
  lines = {int(k.rsplit(":", 1)[1]): e for k, e in zip(out["reject"]["key"],
                                                        out["reject"]["error"])}
  assert {ln for ln, e in lines.items() if e} == set(bad.lines)
  for ln, reason in bad.lines.items():
    assert re.search(reason, lines[ln]), (ln, lines[ln])
  is_bad = np.asarray([bool(e) for e in out["reject"]["error"]])
  assert np.isnan(out["reject"]["p_click"][is_bad]).all()
  assert np.isfinite(out["missing"]["p_click"]).all()
  # every bad row scored as the all-missing row: one value
  assert np.unique(out["missing"]["p_click"][is_bad]).size == 1
  assert out["drop"]["row"].size == 200 and not set(out["drop"]["row"]) & set(
      out["reject"]["row"][is_bad])
  good = out["reject"]["p_click"][~is_bad]
  np.testing.assert_array_equal(good, out["missing"]["p_click"][~is_bad])
  np.testing.assert_array_equal(good, out["drop"]["p_click"])


def test_interrupted_run_resumes_exactly(run, tmp_path):
  full = tmp_path / "full"
  _predict(run, _dev_source(run), full, rows_per_part=64, fmt="tsv")
  part = tmp_path / "part"
  r = _predict(run, _dev_source(run), part, rows_per_part=64, fmt="tsv", max_parts=2)
  assert r == {"interrupted_at": 128}
  assert not os.path.exists(part / predict.INDEX)
  with open(part / "part-000000000064.tsv.tmp999", "w") as f:   # a write cut short
    f.write("garbage")
  index = _predict(run, _dev_source(run), part, rows_per_part=192, fmt="tsv")  # other parts
  assert index["rows"] == 400 and not any(".tmp" in n for n in os.listdir(part))

  def text(d):
    names = sorted(n for n in os.listdir(d) if n.startswith("part-"))
    return "".join(open(os.path.join(d, n)).read() for n in names)
  assert text(full) == text(part)
  assert text(full).splitlines()[0] == "row\tkey\terror\tp_click"
  assert len(text(full).splitlines()) == 401
  assert _predict(run, _dev_source(run), part, rows_per_part=192, fmt="tsv") == index  # done
  with pytest.raises(ConfigError, match="another run"):
    _predict(run, _dev_source(run), part, fmt="parquet")


def test_script_on_one_device_writes_the_same_predictions(run, tmp_path):
  fx, workdir, _, _ = run
  _predict(run, _dev_source(run), tmp_path / "dev8", rows_per_part=128)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "predict.py"), "--config",
         os.path.join(ROOT, "configs", "criteo.py"), "--workdir", workdir, *_overrides(fx),
         "--config.mesh=(1,1)", f"--data={fx['dev']}", f"--out={tmp_path / 'dev1'}",
         "--batch_size=32"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  index = json.loads(proc.stdout.strip().splitlines()[-1])
  assert index["rows"] == 400 and "rows 400" in proc.stderr   # the progress line
  a = predict.read_predictions(str(tmp_path / "dev8"))
  b = predict.read_predictions(str(tmp_path / "dev1"))
  assert a["key"] == b["key"]
  np.testing.assert_allclose(a["p_click"], b["p_click"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("change, field", [
    ({"model.name": "dcnv2"}, "model.name='dlrm' (this config: 'dcnv2')"),
    ({"embedding.dim": 4}, "embedding.dim=16 (this config: 4)"),
    ({"data.vocab_size": 1 << 10}, "data.vocab_size=32768 (this config: 1024)"),
])
def test_checkpoint_of_another_config_is_refused(run, change, field):
  fx, workdir, _, _ = run
  with pytest.raises(ConfigError, match=re.escape(field)):
    predict.restore_model(_config(fx, **change), workdir, BATCH)


def test_config_check_reads_tuples_as_the_checkpoint_stores_them():
  """The saved config is JSON (tuples come back as lists): the same config with tuple
  overrides passes, another value is still named."""
  c = ml_collections.ConfigDict({"model": {"name": "gem", "overrides": {"pyramid": (1.0,)}}})
  saved = json.loads(json.dumps(c.to_dict()))
  predict.check_config(saved, c, "ckpt")
  c.model.overrides.pyramid = (0.5,)
  with pytest.raises(ConfigError, match=re.escape("model.overrides={'pyramid': [1.0]}")):
    predict.check_config(saved, c, "ckpt")


def test_shape_check_names_the_leaf(run):
  _, workdir, _, model = run
  s = model.setup
  abstract = setup_lib.checkpoint_abstract(s.abstract, s.plan)
  step_dir = os.path.join(workdir, "checkpoints", str(STEPS))
  predict.check_shapes(step_dir, abstract)        # the config's own shapes pass
  w = abstract.emb["C1"]["weight"]
  abstract.emb["C1"]["weight"] = jax.ShapeDtypeStruct((w.shape[0] // 2, w.shape[1]), w.dtype)
  with pytest.raises(ConfigError, match=r"emb/C1/weight: checkpoint \(32768, 16\), this config"
                                        r" \(16384, 16\)"):
    predict.check_shapes(step_dir, abstract)


@pytest.mark.slow
def test_two_processes_write_the_one_process_output(run, tmp_path):
  """2 processes x 4 devices (scripts/launch_local.sh) score the text file and resume an
  output that one process started: the rows and probabilities of one process."""
  fx, workdir, _, _ = run
  _predict(run, _dev_source(run), tmp_path / "one", rows_per_part=64)
  started = tmp_path / "two"
  assert _predict(run, _dev_source(run), started, rows_per_part=64, max_parts=3) == {
      "interrupted_at": 192}
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable,
             XLA_FLAGS="--xla_force_host_platform_device_count=4",
             GEM_JAX_SCRIPT=os.path.join(ROOT, "scripts", "predict.py"),
             GEM_JAX_LOG_DIR=str(tmp_path / "logs"))
  for out in (tmp_path / "fresh", started):
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "2", "4", "--",
           "--config", os.path.join(ROOT, "configs", "criteo.py"), "--workdir", workdir,
           *_overrides(fx), "--config.mesh=(2,4)", f"--data={fx['dev']}", f"--out={out}",
           f"--batch_size={BATCH}", "--rows_per_part=32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows"] == 400
  one = predict.read_predictions(str(tmp_path / "one"))
  for out in ("fresh", "two"):
    got = predict.read_predictions(str(tmp_path / out))
    assert got["key"] == one["key"] and np.array_equal(got["row"], one["row"])
    np.testing.assert_allclose(got["p_click"], one["p_click"], atol=1e-6, rtol=0)
  parts = os.listdir(tmp_path / "fresh" / predict.PARTS)
  procs = {json.load(open(tmp_path / "fresh" / predict.PARTS / p))["process"] for p in parts}
  assert procs == {0, 1}
