"""The quality benchmark: its planted data (gem_jax/bench/planted_ctr.py), its table, and one
tiny end-to-end run of scripts/quality_benchmark.py (two models, one seed, a few thousand rows).
"""
import dataclasses
import filecmp
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from data_fixtures import valid_leaves

from gem_jax.bench import planted_ctr
from gem_jax.data.criteo import CAT_NAMES, CriteoSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "quality_benchmark.py")


def _script():
  spec = importlib.util.spec_from_file_location("quality_benchmark", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# ------------------------------------------------------------ planted data --

def test_write_is_deterministic(tmp_path):
  a = planted_ctr.write(str(tmp_path / "a"), "pairs", 3, 500, 300)
  b = planted_ctr.write(str(tmp_path / "b"), "pairs", 3, 500, 300)
  c = planted_ctr.write(str(tmp_path / "c"), "pairs", 4, 500, 300)
  for split in ("train", "eval"):
    assert filecmp.cmp(a[split], b[split], shallow=False)
    assert not filecmp.cmp(a[split], c[split], shallow=False)
  assert a["oracle_auc"] == b["oracle_auc"] != c["oracle_auc"]
  again = planted_ctr.write(str(tmp_path / "a"), "pairs", 3, 500, 300)  # cached by meta.json
  assert again == a


@pytest.mark.parametrize("kind", planted_ctr.KINDS)
def test_every_kind_parses_without_bad_rows(tmp_path, kind):
  n = 2000
  meta = planted_ctr.write(str(tmp_path), kind, 0, n, 500)
  it = CriteoSource(meta["train"], vocab_size=1 << 15).batches(512, repeat=False)
  got = valid_leaves(it)
  assert it.state()["bad_rows"] == {"rows": n, "bad": 0, "reports": []}
  assert len(got["/labels"]) == n
  assert abs(got["/labels"].mean() - 0.25) < 0.04 and abs(meta["train_ctr"] - 0.25) < 0.04
  assert got["/labels"].sum() == round(meta["train_ctr"] * n)
  truth = planted_ctr.make_truth(kind, 0)
  for f in (0, 25):  # the ids are the truth's hex ids
    assert set(got[f"/ids/{CAT_NAMES[f]}"][:, 0].tolist()) <= set(truth.hex_ids[f].tolist())
  assert np.isfinite(got["/dense"]).all() and (got["/dense"] >= 0).all()
  assert meta["oracle_logloss"] < meta["base_logloss"]


def test_interactions_carry_signal(tmp_path):
  """The oracle beats its own first-order part on the same eval rows (pairs)."""
  kind, seed, n = "pairs", 1, 4000
  meta = planted_ctr.write(str(tmp_path), kind, seed, 100, n)
  truth = planted_ctr.make_truth(kind, seed)
  rng = np.random.default_rng([seed, planted_ctr.KINDS.index(kind), 2])  # write()'s eval rows
  d = planted_ctr._draw(truth, rng, n)
  p = 1 / (1 + np.exp(-planted_ctr._logit(truth, d["values"], d["z"])))
  y = (rng.random(n) < p).astype(np.int64)
  assert planted_ctr.auc(y, p) == pytest.approx(meta["oracle_auc"], abs=1e-12)
  labels = valid_leaves(CriteoSource(meta["eval"]).batches(1024, repeat=False))["/labels"][:, 0]
  np.testing.assert_array_equal(labels, y)  # the file's labels are these rows'
  first = dataclasses.replace(truth, pairs=[], triples=[], catdense=[])
  p_first = 1 / (1 + np.exp(-planted_ctr._logit(first, d["values"], d["z"])))
  assert meta["oracle_auc"] > planted_ctr.auc(y, p_first) + 0.03


# ------------------------------------------------------------------- table --

def _record(kind, rows, seed, model, auc, logloss, eps, oracle_auc, oracle_ll=0.4, base=0.56):
  return {"kind": kind, "rows": rows, "seed": seed, "model": model,
          "oracle": {"oracle_auc": oracle_auc, "oracle_logloss": oracle_ll, "base_logloss": base},
          "summary": {"eval_auc": auc, "eval_logloss": logloss, "examples_per_s": eps}}


def test_aggregate():
  qb = _script()
  recs = [_record("pairs", 1000, 0, "lr", 0.70, 0.50, 100.0, 0.90),
          _record("pairs", 1000, 1, "lr", 0.72, 0.48, 300.0, 0.92),
          _record("pairs", 1000, 0, "gem", 0.80, 0.45, 10.0, 0.90),
          _record("pairs", 1000, 1, "gem", 0.76, 0.46, 20.0, 0.92),
          _record("pairs", 1000, 2, "gem", 0.78, 0.44, 40.0, 0.91),  # no lr for seed 2
          _record("triples", 500, 0, "fm", 0.6, 0.5, 5.0, 0.8, 0.3, 0.55)]
  blocks = qb.aggregate(recs)
  assert list(blocks) == [("pairs", 1000), ("triples", 500)]
  lr, gem, oracle, base = blocks[("pairs", 1000)]
  assert [r["model"] for r in (lr, gem, oracle, base)] == ["lr", "gem", "oracle", "base rate"]
  assert lr["seeds"] == [0, 1] and gem["seeds"] == [0, 1, 2] and oracle["seeds"] == [0, 1, 2]
  assert lr["auc_mean"] == pytest.approx(0.71)
  assert lr["auc_std"] == pytest.approx(math.sqrt(2 * 0.01 ** 2))  # sample std
  assert lr["gap_closed"] is None and lr["examples_per_s"] == 200.0
  assert gem["auc_mean"] == pytest.approx(0.78)
  assert gem["auc_std"] == pytest.approx(0.02)  # sqrt((0.02^2 + 0.02^2 + 0) / 2)
  assert gem["logloss_mean"] == pytest.approx(0.45) and gem["examples_per_s"] == 20.0
  assert gem["gap_closed"] == pytest.approx(((0.10 / 0.20) + (0.04 / 0.20)) / 2)
  assert gem["auc"] == {0: 0.80, 1: 0.76, 2: 0.78}
  assert oracle["auc_mean"] == pytest.approx(0.91) and oracle["logloss_mean"] == pytest.approx(0.4)
  assert base["auc_mean"] is None and base["logloss_mean"] == pytest.approx(0.56)
  fm, oracle, base = blocks[("triples", 500)]
  assert fm["gap_closed"] is None and fm["auc_std"] is None and oracle["auc_mean"] == 0.8
  table = qb.format_table(blocks)
  assert "### pairs, 1,000 training rows" in table and "### triples, 500" in table
  assert ("| gem | 0,1,2 | 0.7800 ± 0.0200 | 0.4500 ± 0.0100 | 0.350 | 20 | "
          "0.8000 0.7600 0.7800 |") in table
  assert "| base rate | 0,1,2 |  | 0.5600 ± 0.0000 |" in table


def test_variants_and_model_overrides():
  qb = _script()
  flags = ["--config.model.name=gem", "--config.model.overrides.wukong_mlp=(64,32)",
           "--config.optim.lr=0.01"]
  specs = qb.model_specs(["lr"], ["gem_d32=" + ",".join(flags)])  # the tuple's comma stays
  assert specs == [("lr", ["--config.model.name=lr"]), ("gem_d32", flags)]
  arg, rest = qb.trainer_config(specs[1][1])
  assert arg == qb.CONFIG + ':{"wukong_mlp": [64, 32]}'
  c = qb.resolve(arg, rest)
  assert c.model.name == "gem" and c.optim.lr == 0.01
  assert tuple(c.model.overrides.wukong_mlp) == (64, 32)
  with pytest.raises(SystemExit, match="bad trainer flags"):
    qb.resolve(qb.CONFIG, ["--config.train.stepz=3"])
  with pytest.raises(SystemExit, match="LABEL="):
    qb.model_specs([], ["nolabel"])


# -------------------------------------------------------------- end to end --

def _run(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        timeout=timeout, env=env, check=False)


def test_end_to_end_resume_and_table_only(tmp_path):
  out = str(tmp_path / "q")
  args = ["--out", out, "--rows", "3000", "--eval-rows", "2000", "--seeds", "0", "--models",
          "lr,fm", "--kinds", "pairs", "--extra=--config.data.batch_size=128"]
  p = _run(*args)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(os.path.join(out, "results.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  assert [(r["model"], r["steps"], r["seed"]) for r in recs] == [("lr", 23, 0), ("fm", 23, 0)]
  for r in recs:
    assert r["summary"]["step"] == 23 and 0.5 < r["summary"]["eval_auc"] < r["oracle"]["oracle_auc"]
    assert "--config.train.steps=23" in r["command"] and r["wall_s"] > 0
    workdir = os.path.join(out, "runs", f"pairs_3000_s0_{r['model']}")
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    assert os.path.exists(os.path.join(workdir, "train.log"))
  with open(os.path.join(out, "table.md")) as f:
    table = f.read()
  assert table in p.stdout
  for model in ("lr", "fm", "oracle"):
    row = next(line for line in table.splitlines() if line.startswith(f"| {model} |"))
    assert any(c.strip().replace(".", "", 1).isdigit() for c in row.split("|")[3:5]), row
  assert f"| oracle | 0 | {recs[0]['oracle']['oracle_auc']:.4f} |" in table

  again = _run(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "skip pairs_3000_s0_lr" in again.stdout and "skip pairs_3000_s0_fm" in again.stdout
  with open(os.path.join(out, "results.jsonl")) as f:
    assert len(f.readlines()) == 2
  only = _run("--out", out, "--table-only")
  assert only.returncode == 0, only.stderr[-3000:]
  assert only.stdout == table


@pytest.mark.slow
def test_gem_learns_planted_pairs_that_its_wukong_stack_alone_misses(tmp_path):
  """GEM (default: the front-end pairs reach the trunk) against GEM without them and LR, on
  160k rows of `pairs` (one pass, 20k eval rows). docs/RESULTS.md, "Interaction benchmark",
  has the 1M-row numbers; at 320k rows: LR ~0.82, GEM without the pairs 0.826, GEM 0.862."""
  out = str(tmp_path / "q")
  p = _run("--out", out, "--rows", "160000", "--eval-rows", "20000", "--seeds", "1",
           "--models", "lr,gem", "--kinds", "pairs",
           "--variant", "gem_wukong_only=--config.model.overrides.trunk_pairs=False",
           timeout=1800)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(os.path.join(out, "results.jsonl")) as f:
    auc = {r["model"]: r["summary"]["eval_auc"] for r in map(json.loads, f)}
  print(auc)
  assert auc["gem"] > auc["lr"] + 0.015
  assert auc["gem"] > auc["gem_wukong_only"] + 0.01
