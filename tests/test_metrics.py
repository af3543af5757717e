"""Streaming metrics against exact NumPy references (rank AUC with ties, log loss, NE)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gem_jax.train import metrics


def exact_auc(scores, labels):
  """Rank AUC with mid-ranks for ties (Mann-Whitney U / (P N))."""
  scores = np.asarray(scores, np.float64)
  labels = np.asarray(labels).astype(bool)
  order = np.argsort(scores, kind="mergesort")
  s = scores[order]
  ranks = np.empty(len(s))
  i = 0
  while i < len(s):
    j = i
    while j + 1 < len(s) and s[j + 1] == s[i]:
      j += 1
    ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
    i = j + 1
  p, n = labels.sum(), (~labels).sum()
  return (ranks[labels].sum() - p * (p + 1) / 2) / (p * n)


def ref_logloss(z, y):
  p = 1 / (1 + np.exp(-np.asarray(z, np.float64)))
  return float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p))))


def make_batch(rng, b, t, d):
  y = (rng.random((b, t)) < 0.3).astype(np.float32)
  # Informative logits; task 0 rounded to 0.05 so that exact ties occur, the
  # others continuous (pairs then share bins and the tie bound is exercised).
  z = 1.5 * y - 1.2 + rng.normal(size=(b, t))
  z[:, 0] = np.round(z[:, 0] / 0.05) * 0.05
  m = (rng.random((b, t)) < 0.8).astype(np.float32)
  dom = rng.integers(0, d, size=b).astype(np.int32)
  return z.astype(np.float32), y, m, dom


TASKS = ("click", "conversion")
UPDATE = jax.jit(metrics.update)


@pytest.fixture(scope="module")
def run():
  """Accumulate 4 batches with a jitted update; returns (computed, raw arrays)."""
  rng = np.random.default_rng(0)
  acc = metrics.init_accumulators(len(TASKS), 3, num_bins=2 ** 12)
  zs, ys, ms, ds = [], [], [], []
  for _ in range(4):
    z, y, m, dom = make_batch(rng, 2000, len(TASKS), 3)
    acc = UPDATE(acc, z, y, m, dom)
    zs.append(z), ys.append(y), ms.append(m), ds.append(dom)
  raw = tuple(np.concatenate(x) for x in (zs, ys, ms, ds))
  return acc, metrics.compute(acc, TASKS, 3), raw


def test_auc_matches_exact_rank_auc_per_task_and_domain(run):
  acc, out, (z, y, m, dom) = run
  for t, name in enumerate(TASKS):
    keep = m[:, t] > 0
    ref = exact_auc(z[keep, t], y[keep, t])
    assert abs(out[f"auc/{name}"] - ref) < 1e-3, (name, out[f"auc/{name}"], ref)
    h = np.asarray(acc["hist"][t]).sum(0)
    assert abs(out[f"auc/{name}"] - ref) <= metrics.auc_tie_bound(h[0], h[1]) + 1e-12
    for j in range(3):
      keep_j = keep & (dom == j)
      ref_j = exact_auc(z[keep_j, t], y[keep_j, t])
      assert abs(out[f"auc/{name}/domain_{j}"] - ref_j) < 1e-3
  assert out["auc"] == pytest.approx(np.mean([out[f"auc/{n}"] for n in TASKS]), abs=1e-12)


def test_auc_exact_when_scores_fall_on_distinct_bins():
  # Scores 0.5 apart never share a bin: the histogram AUC is the exact rank AUC.
  z = np.array([[-2.0], [-1.5], [-1.0], [-0.5], [0.0], [0.5], [1.0]], np.float32)
  y = np.array([[0], [1], [0], [0], [1], [0], [1]], np.float32)
  acc = UPDATE(metrics.init_accumulators(1, 1, 1024), z, y, np.ones_like(y),
                       np.zeros(7, np.int32))
  out = metrics.compute(acc, ["click"])
  # Positive ranks 2, 5, 7 among 7: U = 14 - 6 = 8 of 3 * 4 pairs.
  assert out["auc/click"] == pytest.approx(8 / 12, abs=1e-12)


def test_logloss_ne_calibration(run):
  _, out, (z, y, m, dom) = run
  for t, name in enumerate(TASKS):
    keep = m[:, t] > 0
    ll = ref_logloss(z[keep, t], y[keep, t])
    base = y[keep, t].mean()
    h = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    p = 1 / (1 + np.exp(-z[keep, t].astype(np.float64)))
    assert out[f"logloss/{name}"] == pytest.approx(ll, rel=1e-5)
    assert out[f"ne/{name}"] == pytest.approx(ll / h, rel=1e-5)
    assert out[f"calibration/{name}"] == pytest.approx(p.mean() / base, rel=1e-5)
    keep2 = keep & (dom == 2)
    assert out[f"logloss/{name}/domain_2"] == pytest.approx(
        ref_logloss(z[keep2, t], y[keep2, t]), rel=1e-5)
  assert out["ne"] == pytest.approx((out["ne/click"] + out["ne/conversion"]) / 2, rel=1e-12)


def test_label_mask_weights_and_out_of_range_domains_drop():
  rng = np.random.default_rng(1)
  z, y, m, dom = make_batch(rng, 500, 1, 2)
  acc0 = metrics.init_accumulators(1, 2, 256)
  full = UPDATE(acc0, z, y, m, dom)
  # Appending masked rows and rows of an unknown domain changes nothing.
  z2 = np.concatenate([z, rng.normal(size=(50, 1)).astype(np.float32)])
  y2 = np.concatenate([y, np.ones((50, 1), np.float32)])
  m2 = np.concatenate([m, np.r_[np.zeros(25), np.ones(25)][:, None].astype(np.float32)])
  d2 = np.concatenate([dom, np.r_[np.zeros(25), np.full(25, 7)].astype(np.int32)])
  padded = UPDATE(acc0, z2, y2, m2, d2)
  for k in full:
    np.testing.assert_array_equal(np.asarray(full[k]), np.asarray(padded[k]))


def test_streaming_equals_one_shot_and_reset():
  rng = np.random.default_rng(2)
  z, y, m, dom = make_batch(rng, 600, 2, 1)
  acc0 = metrics.init_accumulators(2, 1, 512)
  one = UPDATE(acc0, z, y, m, dom)
  two = UPDATE(UPDATE(acc0, z[:250], y[:250], m[:250], dom[:250]),
                       z[250:], y[250:], m[250:], dom[250:])
  for k in one:
    np.testing.assert_allclose(np.asarray(one[k]), np.asarray(two[k]), rtol=1e-6)
  zero = metrics.reset(one)
  assert all(float(jnp.abs(v).sum()) == 0 for v in zero.values())
  out = metrics.compute(acc0, ["a", "b"])
  assert np.isnan(out["auc/a"]) and np.isnan(out["auc"]) and np.isnan(out["ne/b"])
  # A single domain reports no per-domain keys.
  assert not any("domain_" in k for k in metrics.compute(one, ["a", "b"]))


def test_extreme_logits_land_in_edge_bins():
  z = np.array([[-1e4], [1e4], [np.float32(30.0)]], np.float32)
  y = np.array([[0], [1], [1]], np.float32)
  acc = UPDATE(metrics.init_accumulators(1, 1, 64), z, y, np.ones_like(y),
                       np.zeros(3, np.int32))
  h = np.asarray(acc["hist"])[0, 0]
  assert h[0, 0] == 1 and h[1, 63] == 2 and h.sum() == 3
  out = metrics.compute(acc, ["click"])
  assert out["auc/click"] == 1.0
  assert np.isfinite(out["logloss/click"]) and out["logloss/click"] < 1e-6


def test_update_in_a_sharded_jit_matches_single_device(mesh8):
  """Batch split over the 8-device mesh, accumulators replicated (as in the train state)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  rng = np.random.default_rng(3)
  z, y, m, dom = make_batch(rng, 512, 2, 3)
  acc0 = metrics.init_accumulators(2, 3, 1024)
  want = UPDATE(acc0, z, y, m, dom)
  rep = NamedSharding(mesh8, P())
  rows = NamedSharding(mesh8, P(("replica", "shard")))
  acc_sh = jax.tree.map(lambda _: rep, acc0)
  f = jax.jit(metrics.update, in_shardings=(acc_sh, rows, rows, rows, rows),
              out_shardings=acc_sh, donate_argnums=0)
  got = f(jax.device_put(acc0, rep), *(jax.device_put(x, rows) for x in (z, y, m, dom)))
  for k in want:
    assert got[k].sharding == rep
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-6)
