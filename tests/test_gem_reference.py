"""GEM's whole forward against the float64 NumPy reference (tests/references.py).

GEM is built abstractly from the tiny preset (fp32; nnx.eval_shape + nnx.split), its
parameters are filled with random values (so zero-init biases, time biases, cross-layer
queries and MMoE gates matter too), and `references.gem` recomputes logits and aux from
those arrays alone. Then one parameter per block is perturbed in the model only: the
comparison must fail, and the reference fed the same perturbed arrays agrees again.
"""
import dataclasses
import functools
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

import references as R
from gem_jax.models import GEM, get_config, random_inputs, reference_spec

B = 5
TOL = dict(rtol=1e-5, atol=1e-5)
_SPEC = reference_spec(n_dense=5, n_sparse=4, streams=2, max_len=12, item_features=2,
                       num_domains=3, tasks=("click", "conversion", "like"))
# Two streams of different lengths (12 and 7): block 1 keeps 6 and 4 events.
SPEC = dataclasses.replace(_SPEC, sequences=(
    _SPEC.sequences[0], dataclasses.replace(_SPEC.sequences[1], max_len=7)))
SPEC0 = reference_spec(n_dense=3, n_sparse=3, streams=0, num_domains=2, tasks=("click", "buy"))
# Per-row valid lengths: empty, shorter than num_recent, cropped by the pyramid, full.
LENGTHS = {"stream0": np.asarray([0, 1, 12, 7, 4]), "stream1": np.asarray([5, 0, 1, 7, 2])}
CASES = {
    # tiny as is: 2 streams, cross-layer attention, softmax / full, time bias, towers.
    "streams": (dict(), SPEC),
    # no event stream (one dummy branch of one invalid event), MMoE heads.
    "no_streams_mmoe": (dict(head_kind="mmoe"), SPEC0),
    # the other switches: no cross-layer, silu / block-local, RoPE, no time buckets,
    # 3 recent tokens, no PMA, a steeper pyramid.
    "variants": (dict(cross_layer=False, attn_score="silu", attn_mask="block_local", block_size=4,
                      rope=True, time_buckets=0, num_recent=3, num_pma=0, pyramid=(1.0, 0.25)),
                 SPEC),
    # the interaction switches: raw feature tokens into block 0, every-pair FM, trunk pairs.
    "raw_tokens_pairs": (dict(token_mix=False, wukong_fm="pairs", trunk_pairs=True), SPEC),
    "raw_tokens_no_streams": (dict(token_mix=False, trunk_pairs=True), SPEC0),
}


def feature_dims(spec, d):
  """Mixed widths: some features projected (8, 16), others already d wide."""
  return {f.name: (8, d, 16)[i % 3] for i, f in enumerate(spec.sparse)}


def _keys(key_path):
  """A flatten_with_path key path -> the to_pure_dict path ('blocks', 0, ..., 'kernel')."""
  return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def random_params(abstract_state, seed):
  """Norm scales and the trunk gate 1 + 0.2 N, vectors 0.2 N, matrices N(0, 1 / fan_in)
  (fan_in = shape[-2])."""
  rng = np.random.default_rng(seed)

  def fill(key_path, a):
    if len(a.shape) >= 2:
      v = rng.normal(size=a.shape) / np.sqrt(a.shape[-2])
    else:
      v = (_keys(key_path)[-1] in ("scale", "trunk_gate")) + 0.2 * rng.normal(size=a.shape)
    return v.astype(a.dtype)

  return jax.tree_util.tree_map_with_path(fill, abstract_state)


@functools.lru_cache(maxsize=None)
def build(case):
  """(cfg, spec, feature dims, state, jitted forward, inputs, reference logits and aux)."""
  overrides, spec = CASES[case]
  cfg = get_config("tiny", **overrides)
  assert cfg.dtype == "float32" and cfg.param_dtype == "float32"
  fd = feature_dims(spec, cfg.d_model)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GEM(cfg, spec, fd, rngs=nnx.Rngs(0))))
  state = random_params(abstract, seed=1)
  fwd = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, return_aux=True))
  inputs = random_inputs(spec, fd, B, seed=2,
                         lengths={s.name: LENGTHS[s.name] for s in spec.sequences})
  ref = R.gem(R.params(state), cfg, spec, fd, inputs)
  return cfg, spec, fd, state, fwd, inputs, ref


def _max_err(got, want):
  return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


@pytest.mark.parametrize("case", list(CASES))
def test_gem_forward_matches_numpy_reference(case):
  _, spec, _, state, fwd, inputs, (ref, ref_aux) = build(case)
  logits, aux = fwd(state, inputs)
  assert logits.shape == ref.shape == (B, len(spec.tasks))
  assert np.abs(ref).max() > 0.1  # not a trivially small output
  errs = {k: f"{_max_err(aux[k], ref_aux[k]):.1e}" for k in ("trunk", "seq_summary", "x")}
  print(f"{case}: max |logits - ref| = {_max_err(logits, ref):.1e}, aux {errs}")
  np.testing.assert_allclose(np.asarray(logits), ref, **TOL)
  for k in ("trunk", "seq_summary", "x"):
    np.testing.assert_allclose(np.asarray(aux[k]), ref_aux[k], **TOL, err_msg=k)


# One parameter per block of the 'streams' case (to_pure_dict paths).
PERTURB = [
    ("dense_tok", "mlp", "layers", 0, "kernel"),
    ("sparse_proj", "proj", "8"),
    ("sparse_proj", "proj", "16"),
    ("domain_emb",),
    ("token_mix",),
    ("seq_emb", 0, "item_proj", "kernel"),
    ("seq_emb", 1, "item_norm", "scale"),
    ("seq_emb", 0, "action_emb"),
    ("seq_emb", 1, "surface_emb"),
    ("seq_emb", 0, "time_emb"),
    ("stream_emb",),
    ("blocks", 0, "x_mix"),
    ("blocks", 1, "x_fc1", "kernel"),
    ("blocks", 0, "x_gate", "fc2", "bias"),
    ("blocks", 0, "branches", 0, "pffn", "w_k", "kernel"),
    ("blocks", 1, "branches", 1, "pffn", "norm", "scale"),
    ("blocks", 0, "branches", 1, "cls"),
    ("blocks", 1, "branches", 0, "attn_norm", "bias"),
    ("blocks", 0, "branches", 0, "attn", "qkv", "kernel"),
    ("blocks", 1, "branches", 1, "attn", "q_norm", "scale"),
    ("blocks", 0, "branches", 1, "attn", "time_bias"),
    ("blocks", 1, "branches", 0, "attn", "out", "kernel"),
    ("blocks", 0, "branches", 0, "pma", "seeds"),
    ("blocks", 1, "branches", 1, "pma", "attn", "kv_proj", "kernel"),
    ("blocks", 0, "branches", 0, "s_norm", "scale"),
    ("blocks", 1, "branches", 0, "s_gate", "fc1", "kernel"),
    ("blocks", 0, "interaction", "fmb", "fm", "y"),
    ("blocks", 1, "interaction", "fmb", "norm", "bias"),
    ("blocks", 0, "interaction", "fmb", "mlp", "layers", 0, "kernel"),
    ("blocks", 1, "interaction", "lcb", "w"),
    ("blocks", 0, "interaction", "res"),
    ("blocks", 1, "interaction", "norm", "scale"),
    ("cross_layer", "query"),
    ("cross_layer", "bias"),
    ("query_mix",),
    ("target_attn", 0, "q_proj", "kernel"),
    ("target_attn", 1, "kv_proj", "bias"),
    ("target_attn", 1, "k_norm", "scale"),
    ("trunk", "layers", 0, "kernel"),
    ("heads", "towers", "kernels", 1),
    ("heads", "towers", "biases", 0),
]


def _perturbed(state, path):
  """A copy of `state` with the array at `path` + 0.5 max(std, 0.2) N(0, 1)."""
  def f(key_path, a):
    if _keys(key_path) != path:
      return a
    rng = np.random.default_rng(zlib.crc32(repr(path).encode()))
    a = np.asarray(a)
    return (a + 0.5 * max(float(a.std()), 0.2) * rng.normal(size=a.shape)).astype(a.dtype)

  return jax.tree_util.tree_map_with_path(f, state)


def _param_paths(state):
  return [_keys(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


@pytest.mark.parametrize("path", PERTURB, ids=lambda p: ".".join(map(str, p)))
def test_comparison_fails_when_one_block_parameter_changes(path):
  """This block's parameter perturbed in the model only: the match breaks; the reference
  given the same perturbed arrays agrees again (it reads that parameter as the model does)."""
  cfg, spec, fd, state, fwd, inputs, (ref, _) = build("streams")
  assert path in _param_paths(state)
  new = _perturbed(state, path)
  logits = np.asarray(fwd(new, inputs)[0])
  assert _max_err(logits, ref) > 1e-3, "the reference comparison did not notice the change"
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(logits, ref, **TOL)
  np.testing.assert_allclose(logits, R.gem(R.params(new), cfg, spec, fd, inputs)[0], **TOL)


def test_every_parameter_changes_the_logits():
  """No parameter array of the 'streams' case is dead to the comparison."""
  _, _, _, state, fwd, inputs, (ref, _) = build("streams")
  paths = _param_paths(state)
  dead = [p for p in paths if _max_err(fwd(_perturbed(state, p), inputs)[0], ref) <= 1e-4]
  assert len(paths) > 200 and not dead, dead
