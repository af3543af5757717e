"""GEM end to end on the tiny preset: contract, aux, per-stream branches, jagged invariance,
grads, plain jax.jit."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.layers.heads import masked_multitask_bce
from gem_jax.models import GEM, get_config, random_inputs, reference_spec
from gem_jax.models.gem import pyramid_lengths

B = 4
_SPEC = reference_spec(n_dense=5, n_sparse=4, streams=2, max_len=12, item_features=2)
# Streams of different lengths (12 and 7 events): each keeps its own pyramid schedule.
SPEC = dataclasses.replace(_SPEC, sequences=(
    _SPEC.sequences[0], dataclasses.replace(_SPEC.sequences[1], max_len=7)))


def feature_dims(d):
  return {f.name: (d if i % 2 else 8) for i, f in enumerate(SPEC.sparse)}


@pytest.fixture(scope="module")
def tiny():
  cfg = get_config("tiny")
  fd = feature_dims(cfg.d_model)
  model = GEM(cfg, SPEC, fd, rngs=nnx.Rngs(0))  # no trunk gate (the default): deep path open
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, return_aux=True))
  return cfg, fd, model, state, fwd


def test_trunk_gate_starts_closed_and_opens():
  """At init the deep features reach the trunk scaled by 0 (logits depend on the front-end
  pairs and heads only), and the gate's gradient is nonzero, so training opens it. One
  block and one short stream (the gate does not depend on either), the gradient jitted."""
  spec = reference_spec(n_dense=5, n_sparse=4, streams=1, max_len=4, item_features=1)
  cfg = get_config("tiny", trunk_gate=True, num_blocks=1)
  fd = {f.name: cfg.d_model for f in spec.sparse}
  model = GEM(cfg, spec, fd, rngs=nnx.Rngs(0))
  assert float(model.trunk_gate[...][0]) == 0.0
  x = random_inputs(spec, fd, B, seed=3)
  y = np.random.default_rng(0).integers(0, 2, size=(B, 2)).astype(np.float32)
  graphdef, state = nnx.split(model)
  g = jax.jit(jax.grad(lambda s: masked_multitask_bce(
      nnx.merge(graphdef, s)(x), y, np.ones_like(y))))(state)
  g = nnx.merge(graphdef, g)
  assert abs(float(g.trunk_gate[...][0])) > 0
  assert float(jnp.sum(jnp.abs(g.blocks[0].interaction.lcb.w[...]))) == 0.0  # closed: no grad
  assert GEM(dataclasses.replace(cfg, trunk_gate=False), spec, fd,
             rngs=nnx.Rngs(0)).trunk_gate is None


def test_pyramid_lengths():
  cfg = get_config("tiny", num_blocks=4, pyramid=(1.0, 0.5, 0.2))
  assert pyramid_lengths(cfg, 12) == (12, 6, 3, 3)
  assert pyramid_lengths(get_config("tiny", pyramid=(0.01, 0.0)), 5) == (1, 1)


def test_contract_shapes_and_aux(tiny):
  cfg, fd, model, state, fwd = tiny
  logits, aux = fwd(state, random_inputs(SPEC, fd, B))
  assert logits.shape == (B, len(SPEC.tasks)) and logits.dtype == jnp.float32
  assert aux["trunk"].shape == (B, cfg.trunk_hidden[-1])
  n_sum = cfg.num_cls + cfg.num_pma + cfg.num_recent + cfg.num_queries
  assert aux["seq_summary"].shape == (B, 2 * n_sum * cfg.d_model)  # per stream, concatenated
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_one_branch_per_stream(tiny):
  """Pyramid-parallel: per block one branch (own weights) per stream, own length schedule."""
  cfg, _, model, _, _ = tiny
  assert model.lengths == ((12, 6), (7, 4))
  n_s = cfg.num_cls + cfg.num_pma + cfg.num_recent
  for blk in model.blocks:
    assert len(blk.branches) == 2 and blk.n_s_summary == 2 * n_s
    assert blk.interaction.n_in == cfg.n_interaction + 2 * n_s
    k0, k1 = (np.asarray(b.attn.qkv.kernel[...]) for b in blk.branches)
    assert k0.shape == k1.shape and not np.array_equal(k0, k1)
  assert len(model.target_attn) == 2


def test_padded_events_change_no_output(tiny):
  """Random values (and ids / times) in padded events: every output is unchanged."""
  _, fd, _, state, fwd = tiny
  lengths = {"stream0": np.asarray([0, 3, 12, 7]), "stream1": np.asarray([5, 0, 1, 7])}
  a = random_inputs(SPEC, fd, B, seed=1, lengths=lengths)
  b = random_inputs(SPEC, fd, B, seed=2, lengths=lengths)
  for k in ("dense", "sparse", "domain"):
    b[k] = a[k]
  for s in SPEC.sequences:
    sa, sb = a["seq"][s.name], b["seq"][s.name]
    m = sa["mask"]
    for f in s.item_features:
      sb["items"][f] = np.where(m[..., None], sa["items"][f], 50 * sb["items"][f])
    for k in ("action", "surface", "dt"):
      sb[k] = np.where(m, sa[k], sb[k])
  la, aux_a = fwd(state, a)
  lb, aux_b = fwd(state, b)
  np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(aux_a["seq_summary"]), np.asarray(aux_b["seq_summary"]),
                             rtol=0, atol=1e-6)
  # ...while a change in a valid event does change the output
  b["seq"]["stream0"]["items"]["s0_item0"][1, 0] += 1.0
  assert float(jnp.max(jnp.abs(fwd(state, b)[0] - la))) > 1e-5


def test_grads_finite_and_reach_every_block(tiny):
  _, fd, _, state, _ = tiny
  graphdef = nnx.graphdef(tiny[2])
  x = random_inputs(SPEC, fd, B, seed=3)
  labels = np.random.default_rng(0).integers(0, 2, size=(B, 2)).astype(np.float32)

  def loss(state):
    return masked_multitask_bce(nnx.merge(graphdef, state)(x), labels, np.ones_like(labels))

  g = jax.jit(jax.grad(loss))(state)
  flat = nnx.to_flat_state(g)
  assert all(bool(jnp.all(jnp.isfinite(v[...]))) for _, v in flat)
  for prefix in ("dense_tok", "sparse_proj", "seq_emb", "blocks", "target_attn", "heads"):
    norms = [float(jnp.sum(jnp.abs(v[...]))) for p, v in flat if p[0] == prefix]
    assert norms and sum(norms) > 0, prefix


def test_standalone_module_in_plain_jit(tiny):
  """A GEM module used inside a plain jax.jit function, no trainer and no nnx transform."""
  _, fd, model, _, _ = tiny
  x = jax.tree.map(jnp.asarray, random_inputs(SPEC, fd, B, seed=4))

  @jax.jit
  def predict(inputs):
    return jax.nn.sigmoid(model(inputs))  # the module is a closure constant

  p = predict(x)
  assert p.shape == (B, 2) and bool(jnp.all((p > 0) & (p < 1)))


@pytest.mark.slow
def test_variants_build_and_run():
  """MMoE heads, no cross-layer, silu / block-local attention, remat, no event streams."""
  spec0 = reference_spec(n_dense=3, n_sparse=2, streams=0)
  cases = [(get_config("tiny", d_model=16, head_kind="mmoe", cross_layer=False,
                       attn_score="silu", attn_mask="block_local", block_size=4,
                       remat="full", num_blocks=3), SPEC),
           (get_config("tiny", d_model=16), spec0)]
  for cfg, spec in cases:
    fd = {f.name: 16 for f in spec.sparse}
    m = GEM(cfg, spec, fd, rngs=nnx.Rngs(1))
    gd, st = nnx.split(m)
    x = random_inputs(spec, fd, 2, seed=5)
    g = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(gd, s)(x) ** 2)))(st)
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree.leaves(g))
