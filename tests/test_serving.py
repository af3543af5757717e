"""Serving artifacts (scripts/export.py, gem_jax/serving): parity, quantization, the loader.

* parity: for GEM, DLRM and DCNv2 (tiny, synthetic 'tiny' data: sequences, 2 tasks,
  2 domains; DLRM also with per-table widths and a bf16-stored table), the exported
  function's logits equal the in-process eval forward's bit for bit on a 1 x 1 mesh and
  within 1e-6 (fp32; GEM: twice its logits' 1-ulp rounding noise, measured in the test)
  on the 2 x 4 mesh, on the same rows, and the eval step's
  accumulators (loss, pred) recomputed from them match;
* quantization: a DLRM trained 200 steps, scored on 32k held-out rows (the synthetic
  'oracle' split) with fp32, bf16 and int8 tables: AUC within 0.001 of fp32 (measured:
  < 3e-5), table errors within their formats' bounds;
* the loader needs neither the model code nor flax/optax/orbax, splits batches over
  fixed exported sizes like a symbolic one, names bad fields, maps unseen ids by the
  policy, refuses newer artifact versions;
* the README's "Score and serve" commands run as written (train, predict, export,
  serve over HTTP), and scripts/bench_serving.py reports latencies.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.bench.runner import load_config
from gem_jax.data.synthetic import SyntheticSource, rank_auc
from gem_jax import embedding as emb_lib
from gem_jax.embedding.ids import hash_ids
from gem_jax.serving import export, load, loader
from gem_jax.train import evaluate
from gem_jax.train import metrics as metrics_lib
from gem_jax.train import predict
from gem_jax.train import setup as setup_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
TRAIN = ("--config.model.name=dlrm", "--config.train.steps=200", "--config.train.eval_every=200",
         "--config.train.checkpoint_every=200", "--config.data.batch_size=256",
         "--config.data.eval_batch_size=256", "--config.data.eval_examples=2048",
         "--config.optim.lr=1e-2", "--config.embedding.lr=0.2")


def _tiny(name: str, **changes):
  return load_config("tiny", {"model.name": name, **changes})


def _fresh_model(name: str, batch: int = 64, **changes) -> predict.Model:
  s = setup_lib.setup(predict.scoring_config(_tiny(name, **changes), batch))
  return predict.Model(s, setup_lib.init_state(s, 0), 0)


# ----------------------------------------------------------------------- parity --

PER_TABLE = {"embedding.per_table": "user: dim=4, dtype=bfloat16; ad: dim=12"}
MANAGED = {"embedding.per_table": "*: id_policy=managed, eviction=lfu"}


def _ulp_noise(forward, state, dev, ref) -> float:
  """max |logits - ref| when every float leaf of `state` moves one ulp up, or down (the larger):
  the fp32 rounding noise of the logits at this state, against which two evaluation orders
  of the same function are compared."""
  def nudged(direction):
    return jax.tree.map(lambda x: jnp.nextafter(x, jnp.asarray(direction, x.dtype))
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
  return max(float(np.abs(jax.device_get(forward(nudged(d), dev))["logits"] - ref).max())
             for d in (np.inf, -np.inf))


@pytest.mark.parametrize("name, changes", [("gem", {}), ("dlrm", {}), ("dcnv2", {}),
                                           ("dlrm", PER_TABLE),
                                           pytest.param("dlrm", MANAGED, marks=pytest.mark.slow)],
                         ids=["gem", "dlrm", "dcnv2", "dlrm-per-table", "dlrm-managed"])
def test_exported_logits_match_the_eval_step(name, changes, tmp_path):
  """fp32 artifacts of fresh models; 'dlrm-per-table': tables of other widths, one stored
  in bf16 in training (its rows pooled in bf16, as the sharded lookup does);
  'dlrm-managed': managed tables whose maps saw another batch (half its ids are new)."""
  model = _fresh_model(name, **changes)
  s, state = model.setup, model.state
  batches = iter(s.eval_src.batches(64, seed=0, repeat=False))
  batch = next(batches)
  dev = setup_lib.device_putter(s.eval_plan, s.mesh)(batch)
  if s.plan.managed_tables():   # the maps learn the ids of another batch and half of this one
    seen = {k: v.copy() for k, v in next(batches)["ids"].items()}
    for k in seen:
      seen[k][::2] = batch["ids"][k][::2]
    ids = setup_lib.device_putter(s.eval_plan, s.mesh)({"ids": seen})["ids"]
    emb, _, _ = jax.jit(lambda e, i: emb_lib.managed.resolve(s.eval_plan, e, i, 0))(state.emb,
                                                                                   ids)
    state = state.replace(emb=emb)
    model = predict.Model(s, state, 0)
  sh = jax.tree.map(lambda x: x.sharding, dev)
  forward = predict.forward_fn(model, sh)
  ref = jax.device_get(forward(state, dev))["logits"]
  acc = jax.device_get(evaluate.jit_eval_step(s.eval_cfg, s.shardings, sh)(state, dev))
  export.export_artifact(model, str(tmp_path / "art"))
  got = load(str(tmp_path / "art")).outputs(batch)
  # 1e-6 (issue 20's bound). GEM: twice its logits' fp32 rounding noise, measured here. The
  # export is the one-device program (bitwise equal to the eval forward on one device, the
  # test below); the partitioned eval forward splits its fp32 reductions over devices, so
  # the two differ by rounding alone, which GEM's depth amplifies: its logits (|z| <= 1.46
  # here) move by 1.1-1.6e-6 when every parameter moves one ulp, and the two programs
  # differed by 1.2e-6 on one CPU and 2.3e-6 on another (DLRM 2.4e-7, DCNv2 3.6e-7).
  if name == "gem":
    noise = _ulp_noise(forward, state, dev, ref)
    assert noise < 5e-6, noise            # the noise itself stays at fp32's scale
    bound = 2 * noise
  else:
    bound = 1e-6
  assert np.abs(got["logits"] - ref).max() <= bound
  np.testing.assert_allclose(got["probs"], 1 / (1 + np.exp(-ref.astype(np.float64))), atol=1e-6)
  zero = jax.tree.map(np.zeros_like, acc)
  mine = jax.device_get(metrics_lib.update(zero, got["logits"], batch["labels"],
                                           batch["label_mask"], batch["domain"]))
  for k in ("loss", "pred", "label", "weight"):
    np.testing.assert_allclose(mine[k], acc[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", ["gem", "dlrm", "dcnv2"])
def test_export_is_bitwise_the_one_device_eval_forward(name, tmp_path):
  """On a 1 x 1 mesh the eval forward and the exported function run the same program:
  their logits are equal bit for bit (the difference on a larger mesh is reduction order)."""
  model = _fresh_model(name, mesh=(1, 1))
  s = model.setup
  batch = next(iter(s.eval_src.batches(64, seed=0, repeat=False)))
  dev = setup_lib.device_putter(s.eval_plan, s.mesh)(batch)
  ref = jax.device_get(predict.forward_fn(model, jax.tree.map(lambda x: x.sharding, dev))(
      model.state, dev))["logits"]
  export.export_artifact(model, str(tmp_path / "art"))
  np.testing.assert_array_equal(load(str(tmp_path / "art")).outputs(batch)["logits"], ref)


# -------------------------------------------------------------- a trained model --

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(workdir, restored model, config): a tiny DLRM trained 200 steps on synthetic data."""
  workdir = tmp_path_factory.mktemp("serving") / "run"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
         os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir), *TRAIN]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = _tiny("dlrm", **{"data.batch_size": 256, "data.eval_batch_size": 256,
                            "data.eval_examples": 2048, "train.steps": 200})
  return str(workdir), predict.restore_model(config, str(workdir), 256), config


@pytest.fixture(scope="module")
def held_out():
  """32,768 rows of the synthetic 'oracle' split (never read by training or evaluation)."""
  return SyntheticSource("tiny", seed=0, split="oracle").examples(0, 32768)


def _aucs(probs, rows) -> list[float]:
  out = []
  for t in range(probs.shape[1]):
    m = rows["label_mask"][:, t] > 0
    out.append(rank_auc(probs[m, t], rows["labels"][m, t]))
  return out


def test_quantized_tables_keep_the_auc(trained, held_out, tmp_path):
  _, model, config = trained
  auc, table_bytes = {}, {}
  for dtype in ("float32", "bfloat16", "int8"):
    m = export.export_artifact(model, str(tmp_path / dtype), table_dtype=dtype, config=config)
    auc[dtype] = _aucs(load(str(tmp_path / dtype))(held_out), held_out)
    table_bytes[dtype] = sum(t["bytes"] for t in m["tables"].values())
    for t in m["tables"].values():
      assert t["error"]["max_abs"] <= t["error"]["bound"] + 1e-12
      assert t["error"]["rel_rms"] < {"float32": 1e-12, "bfloat16": 3e-3, "int8": 1e-2}[dtype]
  print("held-out AUC per table dtype:", auc, "table bytes:", table_bytes)
  assert auc["float32"][0] > 0.68                      # it learned (oracle split: 0.707)
  for dtype in ("bfloat16", "int8"):
    assert max(abs(a - b) for a, b in zip(auc[dtype], auc["float32"])) < 1e-3, auc
  assert table_bytes["bfloat16"] * 2 == table_bytes["float32"]
  assert table_bytes["int8"] < 0.4 * table_bytes["float32"]


def test_fixed_batch_sizes_score_like_a_symbolic_batch(trained, held_out, tmp_path):
  _, model, _ = trained
  rows = jax.tree.map(lambda x: x[:11], held_out)
  export.export_artifact(model, str(tmp_path / "sym"))
  export.export_artifact(model, str(tmp_path / "fixed"), batch_sizes=[4, 1])
  fixed = load(str(tmp_path / "fixed"))
  assert sorted(fixed.manifest["functions"]) == ["1", "4"]
  a, b = load(str(tmp_path / "sym"))(rows), fixed(rows)        # 11 rows: 4 + 4 + 3 (padded)
  assert b.shape == (11, 2)
  np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  np.testing.assert_allclose(fixed(jax.tree.map(lambda x: x[:1], rows)), a[:1], atol=1e-6)
  assert fixed(jax.tree.map(lambda x: x[:0], rows)).shape == (0, 2)                # no rows


def test_loader_needs_no_training_code(trained, held_out, tmp_path):
  _, model, _ = trained
  art = str(tmp_path / "art")
  export.export_artifact(model, art, table_dtype="int8", trunk=True)
  rows = jax.tree.map(lambda x: x[:5], held_out)
  np.save(tmp_path / "rows.npy", {k: v for k, v in rows.items() if k != "labels"},
          allow_pickle=True)
  script = (
      "import sys, json, numpy as np\n"
      "import gem_jax.serving as serving\n"
      f"rows = np.load({str(tmp_path / 'rows.npy')!r}, allow_pickle=True).item()\n"
      f"out = serving.load({art!r}).outputs(rows)\n"
      "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'optax', 'orbax',"
      " 'ml_collections') or m.startswith(('gem_jax.train', 'gem_jax.models', 'gem_jax.data',"
      " 'gem_jax.transfer', 'gem_jax.layers')))\n"
      "print(json.dumps({'heavy': heavy, 'probs': out['probs'].tolist(),"
      " 'trunk': out['trunk'].shape}))\n")
  env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=dict(env, PYTHONPATH=ROOT), timeout=300, cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["heavy"] == []
  assert got["trunk"][0] == 5
  np.testing.assert_allclose(got["probs"], load(art)(rows), atol=1e-7)


def test_loader_names_bad_fields_and_maps_unseen_ids(trained, held_out, tmp_path):
  _, model, _ = trained
  art = str(tmp_path / "art")
  export.export_artifact(model, art)
  p = load(art)
  rows = jax.tree.map(lambda x: x[:3], held_out)
  with pytest.raises(ValueError, match="batch field 'dense': shape \\(3, 1\\), expected"):
    p(dict(rows, dense=rows["dense"][:, :1]))
  with pytest.raises(ValueError, match="batch field 'ids/user' is missing"):
    p(dict(rows, ids={k: v for k, v in rows["ids"].items() if k != "user"}))
  with pytest.raises(ValueError, match="batch field 'seq/clicks/dt' is missing"):
    p(dict(rows, seq={"clicks": {k: v for k, v in rows["seq"]["clicks"].items()
                                 if k != "dt"}}))
  with pytest.raises(ValueError, match="'ids/ad': ids must be integers"):
    p(dict(rows, ids=dict(rows["ids"], ad=rows["ids"]["ad"].astype(np.float32))))
  with pytest.raises(ValueError, match="batch field 'domain' is missing"):   # 2 domains
    p({k: v for k, v in rows.items() if k != "domain"})
  with pytest.raises(ValueError, match=re.escape("'domain': 2 at (1,) is outside [0, 2)")):
    p(dict(rows, domain=np.asarray([0, 2, 1])))
  with pytest.raises(ValueError, match="'dense': non-finite value"):
    p(dict(rows, dense=np.where(np.arange(3)[:, None] == 2, np.nan, rows["dense"])))
  long = dict(rows["seq"]["clicks"], len=np.asarray([0, 17, 3]))
  with pytest.raises(ValueError, match=re.escape("'seq/clicks/len': 17 at (1,)")):
    p(dict(rows, seq={"clicks": long}))
  unseen = dict(rows, ids=dict(rows["ids"], user=np.full((3, 1), 1 << 50, np.int64)))
  rows_t = p.manifest["tables"]["user"]["rows"]
  assert (p.prepare(unseen)["ids"]["user"] == hash_ids(np.asarray([1 << 50]), rows_t)[0]).all()
  assert np.isfinite(p(unseen)).all()
  assert "splitmix64" in p.manifest["tables"]["user"]["unseen_ids"]

  newer = str(tmp_path / "newer")
  shutil.copytree(art, newer)
  m = loader.read_manifest(newer)
  m["format_version"] = loader.FORMAT_VERSION + 1
  with open(os.path.join(newer, loader.MANIFEST), "w") as f:
    json.dump(m, f)
  with pytest.raises(ValueError, match=f"format version {loader.FORMAT_VERSION + 1} is newer"):
    load(newer)
  with pytest.raises(FileNotFoundError, match="not a serving artifact"):
    load(str(tmp_path))


def test_error_policy_refuses_ids_out_of_range(tmp_path):
  model = _fresh_model("dlrm", **{"embedding.id_policy": "error"})
  export.export_artifact(model, str(tmp_path / "art"))
  p = load(str(tmp_path / "art"))
  rows = SyntheticSource("tiny", seed=0, split="oracle").examples(0, 2)
  p.prepare(rows)                                           # in range: fine
  rows["ids"]["user"][1, 0] = 10 ** 9
  with pytest.raises(ValueError, match=re.escape("feature 'user': id 1000000000")):
    p.prepare(rows)


# ------------------------------------------------------------------ the commands --

def _readme_block() -> str:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = text[text.index("## Score and serve"):]
  return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_readme_score_and_serve_commands_run(tmp_path):
  block = _readme_block()
  assert "scripts/predict.py" in block and "scripts/export.py" in block
  script = block.replace("runs/", f"{tmp_path}/").replace("python ", f"{sys.executable} ")
  env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                        text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"^ok 200 .*\"probs\"", proc.stdout, re.M), proc.stdout[-2000:]
  assert re.search(r"^bad 400 .*batch field 'dense'", proc.stdout, re.M), proc.stdout[-2000:]
  pred = predict.read_predictions(str(tmp_path / "tiny" / "predictions"))
  assert len(pred["row"]) == 512 and np.isfinite(pred["p_click"]).all()


def test_bench_serving_reports_latency(trained, tmp_path):
  _, model, _ = trained
  export.export_artifact(model, str(tmp_path / "art"))
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"),
         "--artifact", str(tmp_path / "art"), "--batch_sizes=1,64", "--seconds=0.2"]
  env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["batch"] for r in rows] == [1, 64]
  for r in rows:
    assert 0 < r["p50_ms"] <= r["p99_ms"] and r["rows_per_s"] > 0 and r["calls"] >= 3
