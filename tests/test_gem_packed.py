"""GEM on packed histories (seq_pack_tokens > 0) computes the padded model's function.

References: the padded GEM of the same parameters (logits and gradients, fp32), the
docstring's worked example of `gem_jax.layers.packed`, and the host-side first-fit plan
of `gem_jax.data.packing` (same rows used).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import make_mesh
from gem_jax.data.packing import pack_plan
from gem_jax.layers import packed
from gem_jax.models import GEM, get_config, random_inputs, reference_spec
from gem_jax.bench import runner
from gem_jax.parallel import sharding
from gem_jax.train import loop

L = 24


def _setup(batch=8, seed=1, **overrides):
  spec = reference_spec(max_len=L, streams=2)
  cfg = get_config("tiny", **overrides)
  dims = {f.name: cfg.d_model for f in spec.sparse}
  inputs = jax.tree.map(jnp.asarray, random_inputs(spec, dims, batch=batch, seed=seed))
  return spec, cfg, dims, inputs


def _packed(cfg, rows):
  return dataclasses.replace(cfg, seq_pack_tokens=cfg.num_cls + L + 8, seq_pack_rows=rows)


def _logits_and_grads(cfg, spec, dims, inputs):
  model = GEM(cfg, spec, dims, rngs=nnx.Rngs(0))

  def loss(m):
    return jnp.sum(jnp.sin(m(inputs)))

  logits, grads = nnx.jit(lambda m: (m(inputs), nnx.grad(loss)(m)))(model)
  return np.asarray(logits), jax.tree.map(np.asarray, nnx.state(grads))


def _forward(model, inputs):
  """The model's logits, jitted (an eager GEM forward dispatches op by op: slower than a
  compile)."""
  return nnx.jit(lambda m, x: m(x))(model, inputs)


def _assert_same_function(a, b, tol=1e-5):
  (la, ga), (lb, gb) = a, b
  np.testing.assert_allclose(la, lb, atol=tol, rtol=0)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ga))
  worst = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(ga),
                                                          jax.tree.leaves(gb)))
  assert worst <= tol * scale, (worst, scale)


@pytest.mark.parametrize("overrides", [
    {},                                                   # softmax, full, time bias, pyramid
    pytest.param(dict(seq_layer="hstu", attn_mask="causal"), marks=pytest.mark.slow),
    pytest.param(dict(attn_score="silu", rope=True, attn_impl="chunked", attn_chunk=8),
                 marks=pytest.mark.slow),
])
def test_packed_gem_equals_padded_gem(overrides):
  """Logits within 1e-5 and gradients within 1e-5 of the largest (fp32 reduction order)."""
  spec, cfg, dims, inputs = _setup(**overrides)
  lengths = np.asarray(next(iter(inputs["seq"].values()))["mask"]).sum(1)
  assert lengths.min() < L and lengths.max() > 0  # jagged, some pyramid-cropped
  padded = _logits_and_grads(cfg, spec, dims, inputs)
  packed_cfg = _packed(cfg, rows=6)
  model = GEM(packed_cfg, spec, dims, rngs=nnx.Rngs(0))
  assert model.packing and bool(all(pk.fits for pk in model.plans(inputs)))
  _assert_same_function(padded, _logits_and_grads(packed_cfg, spec, dims, inputs))


def test_histories_that_do_not_fit_give_nan_logits():
  """One row per shard cannot hold 8 histories: every logit is NaN, never a wrong value
  (the trainer steps such a batch with the padded model, test below)."""
  spec, cfg, dims, inputs = _setup()
  model = GEM(_packed(cfg, rows=1), spec, dims, rngs=nnx.Rngs(0))
  assert not bool(jnp.all(jnp.stack([pk.fits for pk in model.plans(inputs)])))
  assert np.isnan(np.asarray(_forward(model, inputs))).all()
  assert np.isfinite(np.asarray(_forward(GEM(_packed(cfg, rows=6), spec, dims,
                                             rngs=nnx.Rngs(0)), inputs))).all()


def test_packed_gem_on_a_sharded_batch_matches_one_device():
  """2 x 4 mesh: each of the 8 batch shards packs its own 2 users (no cross-device gather)."""
  spec, cfg, dims, inputs = _setup(batch=16, seed=3)
  want = _forward(GEM(cfg, spec, dims, rngs=nnx.Rngs(0)), inputs)
  mesh = make_mesh(2, 4)
  model = GEM(_packed(cfg, rows=2), spec, dims, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  batch = jax.device_put(inputs, sharding.batch_sharding(mesh))

  @jax.jit
  def run(state, batch):
    with sharding.activation_sharding(mesh):
      m = nnx.merge(graphdef, state)
      plans = m.plans(batch)
      return m(batch), jnp.all(jnp.stack([pk.fits for pk in plans])), plans[0].user.shape

  logits, fits, _ = run(state, batch)
  assert bool(fits)
  with sharding.activation_sharding(mesh):
    assert sharding.batch_groups() == 8
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=0)


def test_plan_worked_example():
  """The module docstring's example: c = 1, lengths (3, 0, 1), T = 4, R = 2."""
  p = packed.plan(jnp.array([3, 0, 1]), groups=1, num_cls=1, width=3, rows=2, capacity=4)
  assert bool(p.fits)
  np.testing.assert_array_equal(p.user[0], [[0, 0, 0, 0], [2, 2, 1, 0]])
  np.testing.assert_array_equal(p.slot[0], [[0, 1, 2, 3], [0, 1, 0, 0]])
  np.testing.assert_array_equal(p.seg[0], [[0, 0, 0, 0], [1, 1, 2, 3]])
  np.testing.assert_array_equal(p.valid[0], [[1, 1, 1, 1], [1, 1, 1, 0]])
  x = jnp.arange(9.0).reshape(3, 3) + 1  # user n's event j = 3 n + j + 1
  np.testing.assert_array_equal(packed.pack_events(p, x, 1), [[0, 1, 2, 3], [0, 7, 0, 0]])
  np.testing.assert_array_equal(packed.unpack(p, packed.pack_events(p, x, 1), 1, 4),
                                [[1, 2, 3], [0, 0, 0], [7, 0, 0]])


def test_plan_uses_the_host_first_fit_rows_and_round_trips():
  """Random log-normal-ish lengths: the device plan needs exactly the rows the host's
  first-fit decreasing plan needs, one row fewer does not fit, and unpack(pack) == x."""
  rng = np.random.default_rng(0)
  c, width, T = 2, 40, 48
  lengths = np.clip(np.round(rng.lognormal(np.log(10), 1.0, 32)), 0, width).astype(np.int64)
  rows = pack_plan(lengths + c, T).rows
  p = packed.plan(jnp.asarray(lengths), groups=1, num_cls=c, width=width, rows=rows,
                  capacity=T)
  assert bool(p.fits)
  assert not bool(packed.plan(jnp.asarray(lengths), groups=1, num_cls=c, width=width,
                              rows=rows - 1, capacity=T).fits)
  assert int(p.valid.sum()) == int((lengths + c).sum())  # every slot once, no padding
  x = jnp.asarray(rng.normal(size=(32, width)), jnp.float32)
  x = jnp.where(jnp.arange(width)[None] < lengths[:, None], x, 0.0)
  np.testing.assert_array_equal(packed.unpack(p, packed.pack_events(p, x, c), c, c + width), x)


@pytest.mark.parametrize("overrides, match", [
    (dict(seq_pack_rows=0), "seq_pack_rows"),
    (dict(seq_pack_rows=2, attn_mask="block_local"), "block_local"),
    (dict(seq_pack_rows=2, seq_pack_tokens=L), "cannot hold stream"),
])
def test_packing_config_errors(overrides, match):
  spec = reference_spec(max_len=L, streams=2)
  cfg = get_config("tiny", seq_pack_tokens=64, **{k: v for k, v in overrides.items()
                                                   if k != "seq_pack_tokens"})
  if "seq_pack_tokens" in overrides:
    cfg = dataclasses.replace(cfg, seq_pack_tokens=overrides["seq_pack_tokens"])
  with pytest.raises(ValueError, match=match):
    GEM(cfg, spec, {f.name: cfg.d_model for f in spec.sparse}, rngs=nnx.Rngs(0))


# ------------------------------------------------------------- the trainer --

def _long_seq_run(workdir, rows, steps=3):
  """configs/long_seq.py shrunk: max_len 64, 16 users (2 a shard), a few steps."""
  c = runner.load_config("long_seq")
  c.data.update(max_len=64, median=20.0, batch_size=16, eval_batch_size=16, eval_examples=32)
  c.model.overrides.update(seq_pack_tokens=68 if rows else 0, seq_pack_rows=rows)
  c.train.update(steps=steps, log_every=1, eval_every=0, checkpoint_every=0, eval_batches=2)
  out = loop.train_and_evaluate(c, str(workdir))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f]
  return out, {r["step"]: r for r in lines if "train_loss" in r}, lines[0]


@pytest.mark.slow  # three short trainer runs: ~2 min on 2 loaded cores
def test_trainer_steps_packed_where_batches_fit_and_padded_where_not(tmp_path):
  """Same losses step for step (1e-5) for padded, packed (rows balanced over the shards)
  and all-fallback runs; the fallback count is reported, and evaluation (the padded
  twin) agrees."""
  pad_out, pad, pad_head = _long_seq_run(tmp_path / "pad", rows=0)
  pk_out, pk, pk_head = _long_seq_run(tmp_path / "pk", rows=2)
  _, fb, _ = _long_seq_run(tmp_path / "fb", rows=1)  # 2 histories never fit 1 row of 68
  assert "pack_fallback_steps" not in pad[3]
  # MFU counts useful FLOPs (the first batch's real lengths) when packing, padded otherwise
  assert (pad_head["flops_count"], pk_head["flops_count"]) == ("padded",
                                                                "real_tokens_first_batch")
  assert pk_head["train_flops_per_example"] < pad_head["train_flops_per_example"]
  assert pk[3]["pack_fallback_steps"] == 0 and fb[3]["pack_fallback_steps"] == 3
  for step in (1, 2, 3):
    assert abs(pk[step]["train_loss"] - pad[step]["train_loss"]) <= 1e-5, step
    assert abs(fb[step]["train_loss"] - pad[step]["train_loss"]) <= 1e-5, step
  assert abs(pk_out["eval_auc"] - pad_out["eval_auc"]) <= 1e-4


def test_balanced_reorders_rows_evenly_and_fit_replays_the_device_plan():
  """`balanced`: a permutation of every batch leaf (rows stay whole), shards' event counts
  within the longest history; `Fit.shard_fits` agrees with the device plan's `fits`."""
  from gem_jax.train import packing as packing_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  n, shards = 32, 4
  lengths = np.sort(rng.integers(0, L + 1, n))[::-1].copy()  # sorted: the worst order
  batch = {"seq": {"s": {"len": lengths}}, "labels": np.arange(n)[:, None],
           "ids": {"f": np.arange(n) * 10}}
  fit = packing_lib.Fit(("s",), num_cls=2, tokens=L + 2, rows=3)
  out = packing_lib.balanced(fit, shards)(batch)
  perm = out["labels"][:, 0]
  assert sorted(perm.tolist()) == list(range(n))
  np.testing.assert_array_equal(out["seq"]["s"]["len"], lengths[perm])
  np.testing.assert_array_equal(out["ids"]["f"], perm * 10)
  per_shard = out["seq"]["s"]["len"].reshape(shards, -1).sum(1)
  assert per_shard.max() - per_shard.min() <= lengths.max()
  assert np.ptp(lengths.reshape(shards, -1).sum(1)) > np.ptp(per_shard)
  for shard in (lengths[:8], lengths[-8:], out["seq"]["s"]["len"][:8]):
    device = packed.plan(jnp.asarray(shard), groups=1, num_cls=2, width=L, rows=3,
                         capacity=L + 2).fits
    assert fit.shard_fits(shard) == bool(device)
