"""The jitted train step: sharded == single-device, grad accumulation == full batch,
state donated, metrics stay on device; eval_step fills the accumulators."""
import jax
import numpy as np
import pytest

from conftest import make_mesh
from gem_jax.embedding import export_state
from gem_jax.train import evaluate, metrics
from test_step_fixtures import Built, make_batch

STEPS = 3


def _run(mesh, grad_accum=1, steps=STEPS):
  built = Built(mesh, grad_accum=grad_accum)
  state = built.init()
  batches = [built.put(make_batch(i)) for i in range(steps)]
  fn = built.step_fn(batches[0])
  losses = []
  for b in batches:
    state, m = fn(state, b)
    losses.append(m["train_loss"])
  return built, state, [float(x) for x in losses]


@pytest.fixture(scope="module")
def reference():
  return _run(make_mesh(1, 1))


def _host(built, state):
  params = jax.tree.map(np.asarray, state.params)
  return params, jax.tree.map(np.asarray, export_state(built.plan, state.emb))


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_sharded_step_matches_single_device(reference, shape):
  ref_built, ref_state, ref_losses = reference
  built, state, losses = _run(make_mesh(*shape))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  (p, e), (rp, re) = _host(built, state), _host(ref_built, ref_state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, rp)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), e, re)
  assert int(state.step) == STEPS


def test_grad_accumulation_equals_full_batch(reference):
  ref_built, ref_state, ref_losses = reference
  built, state, losses = _run(make_mesh(1, 2), grad_accum=4)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  (p, e), (rp, re) = _host(built, state), _host(ref_built, ref_state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p, rp)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), e, re)


def test_state_is_donated_and_metrics_stay_on_device():
  built = Built(make_mesh(2, 2))
  state = built.init()
  batch = built.put(make_batch(0))
  fn = built.step_fn(batch)
  kernel = state.params["l1"]["kernel"][...]
  new, m = fn(state, batch)
  assert kernel.is_deleted()
  assert all(isinstance(v, jax.Array) for v in m.values())
  assert set(m) >= {"train_loss", "grad_norm", "lr"}
  assert float(m["lr"]) == 0.0 and int(new.step) == 1  # warm-up starts at 0


def test_eval_step_accumulates_masked_labels():
  built = Built(make_mesh(2, 2))
  state = built.init()
  batch = make_batch(1)
  dev = built.put(batch)
  fn = evaluate.jit_eval_step(built.cfg, built.shardings, jax.tree.map(lambda x: x.sharding, dev))
  state = state.replace(metrics=fn(state, dev))
  acc = jax.device_get(state.metrics)
  np.testing.assert_allclose(acc["weight"].sum(axis=1), batch["label_mask"].sum(axis=0))
  np.testing.assert_allclose(acc["label"].sum(axis=1),
                             (batch["labels"] * batch["label_mask"]).sum(axis=0))
  out = metrics.compute(acc, ("click", "conv"), 2)
  assert 0.0 <= out["auc/click"] <= 1.0


def test_lr_schedule_warmup_then_cosine():
  from gem_jax.train.optim import lr_schedule, sparse_lr_schedule
  import jax.numpy as jnp
  f = lr_schedule(1.0, steps=110, warmup_steps=10, decay="cosine", final_lr_fraction=0.1)
  np.testing.assert_allclose([float(f(t)) for t in (0, 5, 10)], [0.0, 0.5, 1.0], atol=1e-6)
  # Half-way through the decay: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55.
  np.testing.assert_allclose(float(f(60)), 0.55, atol=1e-6)
  np.testing.assert_allclose(float(f(110)), 0.1, atol=1e-6)
  g = lr_schedule(2.0, steps=50, warmup_steps=0, decay="constant")
  assert float(g(0)) == float(g(49)) == 2.0
  s = sparse_lr_schedule(0.2, warmup_steps=4)
  np.testing.assert_allclose([float(s(jnp.int32(t))) for t in (0, 3, 10)], [0.05, 0.2, 0.2],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="decay"):
    lr_schedule(1.0, 10, decay="linear")
