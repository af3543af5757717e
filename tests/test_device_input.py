"""Device-side synthetic input (gem_jax/data/device_synthetic.py): a drop-in for the host path.

The generated batch must be what the jitted train step receives from
`setup.device_putter`: same tree, shapes, dtypes and shardings, ids valid rows
of their tables; and `scripts/benchmark.py --input device` must run.
"""
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.bench import runner
from gem_jax.data import device_synthetic as ds
from gem_jax.data.spec import DataSpec, SparseFeatureSpec, validate_batch
from gem_jax.train import setup as setup_lib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# tiny: one stream, shared table (8 devices, 2 x 4); small: two streams, a bag-4 feature,
# id_policy 'error'; dlrm_peer: no sequences (seq = {}), bags of 3, one table per feature.
CONFIGS = {
    "tiny": {},
    "small": {"data.batch_size": 64},
    "dlrm_peer": {"data.rows": 1000, "data.batch_size": 64, "data.pool": 2, "data.pooling": 3},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
  """(setup, config, host device batch, device generator) of one config on the 8 CPU devices."""
  c = runner.fit_mesh(runner.load_config(request.param, CONFIGS[request.param]), 8)
  s = setup_lib.setup(c)
  host = runner.device_batches(s, c, 1)[0]
  gen = ds.device_batch_fn(s.spec, c.data.batch_size, s.mesh, plan=s.plan, seed=c.seed)
  return s, c, host, gen


def test_drop_in_for_the_host_path(case):
  """Same tree structure, shapes, dtypes and shardings as device_putter's batch."""
  s, c, host, gen = case
  b = gen(0)
  assert jax.tree.structure(b) == jax.tree.structure(host)
  assert ds.differences(b, host) == []
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(b)[0], jax.tree.leaves(host)):
    assert x.sharding == y.sharding, jax.tree_util.keystr(path)
    assert x.sharding.spec[0] == ("replica", "shard")   # split over the batch axis
  assert b["dense"].shape[0] == c.data.batch_size
  validate_batch(s.spec, jax.device_get(b), "device batch")
  # the generator built from the host batch's shardings (what the benchmark does) agrees
  gen2 = runner.device_input(s, c, host)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(gen2(0)), jax.device_get(b))


def test_ids_are_valid_rows_and_padding_is_consistent(case):
  s, _, _, gen = case
  b = jax.device_get(gen(5))
  rows = ds.table_rows(s.spec, s.plan)
  stream_of = {f: st for st in s.spec.sequences for f in st.item_features}
  for f in s.spec.sparse:
    ids = b["ids"][f.name]
    valid = ids >= 0
    assert ids.dtype == np.int32 and ids.min() >= -1 and ids.max() < rows[f.name], f.name
    assert (ids[valid] < rows[f.name]).all()
    if f.name in stream_of:          # item ids exactly at positions < len
      length = b["seq"][stream_of[f.name].name]["len"]
      np.testing.assert_array_equal(valid, np.arange(ids.shape[1])[None] < length[:, None])
    elif f.bag > 1:                  # 1..bag ids, left-aligned, some bags padded
      n = valid.sum(1)
      assert n.min() >= 1 and (n < f.bag).any()
      np.testing.assert_array_equal(valid, np.arange(f.bag)[None] < n[:, None])
    else:
      assert valid.all()
  for st in s.spec.sequences:
    q = b["seq"][st.name]
    valid = np.arange(st.max_len)[None] < q["len"][:, None]
    assert q["len"].min() >= 0 and q["len"].max() <= st.max_len and (q["len"] < st.max_len).any()
    assert (q["action"][valid] >= 1).all() and (q["action"] < st.num_actions).all()
    assert (q["surface"] < st.num_surfaces).all() and (q["surface"] >= 0).all()
    assert (q["dt"][valid] > 0).all()
    assert (np.diff(q["dt"], axis=1)[valid[:, 1:]] > 0).all()   # older events further back
    for k in ("action", "surface", "dt"):
      assert (q[k][~valid] == 0).all(), k
  assert (0 <= b["domain"]).all() and (b["domain"] < s.spec.num_domains).all()
  assert set(np.unique(b["labels"])) <= {0.0, 1.0} and (b["label_mask"] == 1).all()


def test_keys_select_the_batch(case):
  """Same key same batch; another key another batch; an int step = fold_in(key(seed), step)."""
  _, c, _, gen = case
  a, a2, other = (jax.device_get(x) for x in (gen(3), gen(3), gen(4)))
  jax.tree.map(np.testing.assert_array_equal, a, a2)
  assert not np.array_equal(a["dense"], other["dense"])
  for f in a["ids"]:
    assert not np.array_equal(a["ids"][f], other["ids"][f]), f
  key = jax.random.fold_in(jax.random.key(c.seed), 3)
  for k in (key, jax.random.key_data(key)):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(gen(k)), a)


def test_zipf_ids_follow_the_documented_law():
  """P(rank k) = ((k+2)^(1-s) - (k+1)^(1-s)) / ((V+1)^(1-s) - 1), rank k at row (a k + c) mod V;
  zipf 0: uniform rows."""
  v, s_exp, n = 1000, 1.05, 1 << 18
  spec = DataSpec(n_dense=1, sparse=(SparseFeatureSpec("x", vocab=v),))
  mesh = make_mesh(1, 1)
  ids = jax.device_get(ds.device_batch_fn(spec, n, mesh, zipf=s_exp)(0)["ids"]["x"][:, 0])
  # pylint: disable=protected-access
  a, c = ds._multiplier(v), (1 * 0x9E3779B1) % v   # feature 0's multiplier and offset
  assert math.gcd(a, v) == 1
  freq = np.bincount(ids, minlength=v) / n
  k = np.arange(5)
  e = 1 - s_exp
  want = ((k + 2.0) ** e - (k + 1.0) ** e) / ((v + 1.0) ** e - 1)
  np.testing.assert_allclose(freq[(a * k + c) % v], want, rtol=0.05)
  assert len(np.unique(ids)) > v // 2
  uni = jax.device_get(ds.device_batch_fn(spec, n, mesh, zipf=0)(0)["ids"]["x"][:, 0])
  counts = np.bincount(uni, minlength=v)
  assert uni.min() >= 0 and uni.max() < v and counts.max() < 3 * n / v


def test_mulmod_is_exact_near_2_31():
  # pylint: disable=protected-access
  m = 2**31 - 1
  x = np.array([0, 1, 2, m - 1, m - 2, 123456789, 2**30], np.uint32)
  for a in (1, 2, ds._multiplier(m), m - 1):
    got = np.asarray(jax.jit(lambda y, a=a: ds._mulmod(y, a, m))(x))
    np.testing.assert_array_equal(got, [(a * int(i)) % m for i in x])


def test_weights_and_mismatches_are_reported():
  spec = DataSpec(n_dense=2, sparse=(SparseFeatureSpec("x", vocab=50, bag=4),), tasks=("a", "b"))
  gen = ds.device_batch_fn(spec, 16, make_mesh(2, 4), weights=("x",))
  b = jax.device_get(gen(1))
  w, ids = b["weights"]["x"], b["ids"]["x"]
  assert w.dtype == np.float32 and ((w > 0) == (ids >= 0)).all() and w.max() <= 1
  assert b["labels"].shape == (16, 2)
  diff = ds.differences(b, {**b, "dense": np.zeros((16, 3), np.float32)})
  assert diff == ["['dense']: float32(16, 2) != float32(16, 3)"]
  assert "tree structure" in ds.differences(b, {**b, "seq": {"s": {}}})[0]
  with pytest.raises(ValueError, match="unknown features"):
    ds.device_batch_fn(spec, 16, make_mesh(1, 1), weights=("y",))
  with pytest.raises(ValueError, match="not divisible"):
    ds.device_batch_fn(spec, 12, make_mesh(1, 8))


# ------------------------------------------------------------ benchmark.py run --

def _bench(*extra, timeout=300):
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--config", "tiny",
         "--json", "--no-hugepages", *extra]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                        check=False)


def test_benchmark_with_device_input_writes_a_json_line():
  p = _bench("--devices", "2", "--steps", "2", "--warmup", "1", "--input", "device",
             "--no-warm-compile", "--no-dense-part")
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert len(rows) == 1
  r = rows[0]
  assert r["input"] == "device" and r["pool"] is None and r["devices"] == 2
  assert r["input_ms_median"] > 0 and r["input_compile_s"] > 0 and r["steps"] == 2
  assert np.isfinite(r["loss_first"]) and np.isfinite(r["loss_last"])
  assert len(r["warmup_losses"]) == 1   # the warm-up step read the source's first batch
  assert "input" in p.stderr and "generated on the devices" in p.stderr


def test_benchmark_peer_needs_host_input():
  p = _bench("--peer", "torchrec", "--input", "device", timeout=60)
  assert p.returncode != 0 and "use --input host" in p.stderr
