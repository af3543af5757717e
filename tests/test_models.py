"""DLRM / DCNv2 against a numpy TorchRec-formula reference (and TorchRec itself, slow), student."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.data.spec import DataSpec, SparseFeatureSpec
from gem_jax.models import DCNv2, DLRM, GEM, Student, get_config, load_torchrec_state
from gem_jax.models import random_inputs, reference_spec

T, D = 3, 8
SPEC = DataSpec(n_dense=13, sparse=tuple(SparseFeatureSpec(f"f{i}", 100) for i in range(T)))
FD = {f"f{i}": D for i in range(T)}
CFG = get_config("tiny", d_model=D, bottom_mlp=(16,), top_mlp=(16, 12), dcn_layers=2, dcn_rank=4)


def _np_mlp(layers, x, relu_last):
  for j, l in enumerate(layers):
    x = x @ np.asarray(l.kernel[...], np.float64) + np.asarray(l.bias[...], np.float64)
    if j < len(layers) - 1 or relu_last:
      x = np.maximum(x, 0)
  return x


def _np_dlrm(m, x):
  """TorchRec DLRM / DLRM_DCN forward (torchrec.models.dlrm), written in NumPy."""
  dense_out = _np_mlp(m.bottom.layers, x["dense"].astype(np.float64), True)  # (B, D)
  z = np.stack([dense_out] + [x["sparse"][f"f{i}"] for i in range(T)], 1)  # (B, T+1, D)
  if m.crossnet is None:
    zz = z @ z.transpose(0, 2, 1)
    iu = np.triu_indices(T + 1, 1)
    inter = np.concatenate([dense_out, zz[:, iu[0], iu[1]]], 1)
  else:
    x0 = z.reshape(len(z), -1)
    inter = x0
    for v, w in zip(m.crossnet.v, m.crossnet.w):
      V, W = np.asarray(v.kernel[...]).T, np.asarray(w.kernel[...]).T
      inter = x0 * ((W @ (V @ inter.T)).T + np.asarray(w.bias[...])) + inter
  h = _np_mlp(m.top.layers, inter, True)
  return h @ np.asarray(m.out.kernel[...]) + np.asarray(m.out.bias[...])


@pytest.mark.parametrize("cls", [DLRM, DCNv2])
def test_dlrm_dcn_match_reference(cls):
  m = cls(CFG, SPEC, FD, rngs=nnx.Rngs(0))
  x = random_inputs(SPEC, FD, 5)
  y, aux = m(x, return_aux=True)
  assert y.shape == (5, 1) and y.dtype == jnp.float32 and aux["trunk"].shape == (5, 12)
  if cls is DLRM:
    assert aux["interaction"].shape == (5, D + T * (T + 1) // 2)
  np.testing.assert_allclose(np.asarray(y), _np_dlrm(m, x), rtol=1e-4, atol=1e-5)


def test_dlrm_with_streams_and_projection():
  spec = reference_spec(n_dense=4, n_sparse=2, streams=1, max_len=6, item_features=1)
  fd = {"c0": 8, "c1": 4, "s0_item0": 8}
  m = DLRM(CFG, spec, fd, rngs=nnx.Rngs(0))
  x = random_inputs(spec, fd, 3, lengths={"stream0": np.asarray([0, 2, 6])})
  y = m(x)
  x2 = jax.tree.map(lambda a: a, x)
  mask = x["seq"]["stream0"]["mask"]
  x2["seq"]["stream0"]["items"]["s0_item0"] = np.where(mask[..., None], x["seq"]["stream0"][
      "items"]["s0_item0"], 99.0).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(m(x2)))
  assert bool(jnp.all(jnp.isfinite(y)))


TORCHREC_PY = os.environ.get(
    "GEM_JAX_TORCHREC_PYTHON",
    os.path.expanduser("~/.cache/gem_jax/torchrec-venv/bin/python"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TORCHREC_PY), reason=f"no TorchRec venv at {TORCHREC_PY} "
                    "(bash benchmarks/torchrec/setup.sh makes ~/.cache/gem_jax/torchrec-venv; "
                    "or set GEM_JAX_TORCHREC_PYTHON)")
@pytest.mark.parametrize("kind", ["dot", "dcn"])
def test_matches_torchrec_exactly(tmp_path, kind):
  """Same weights and inputs through torchrec.models.dlrm and ours: same logits (fp32)."""
  script = textwrap.dedent(f"""
    import json, numpy as np, torch
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    torch.manual_seed(0)
    T, D, B, R = {T}, {D}, 6, 50
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{{i}}", embedding_dim=D,
        num_embeddings=R, feature_names=[f"f{{i}}"]) for i in range(T)])
    kw = dict(embedding_bag_collection=ebc, dense_in_features=13,
              dense_arch_layer_sizes=[16, D], over_arch_layer_sizes=[16, 12, 1])
    m = DLRM(**kw) if "{kind}" == "dot" else DLRM_DCN(**kw, dcn_num_layers=2, dcn_low_rank_dim=4)
    with torch.no_grad():
      for p in m.parameters(): p.add_(0.1 * torch.randn_like(p))  # non-zero DCN biases too
    rng = np.random.default_rng(0)
    dense = torch.tensor(rng.normal(size=(B, 13)), dtype=torch.float32)
    ids = rng.integers(0, R, size=(T, B))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{{i}}" for i in range(T)],
        values=torch.tensor(ids.reshape(-1)), lengths=torch.ones(T * B, dtype=torch.int32))
    with torch.no_grad():
      out = m(dense, kjt).numpy()
    sd = {{k: v.numpy() for k, v in m.state_dict().items()}}
    np.savez("{tmp_path}/ref.npz", out=out, dense=dense.numpy(), ids=ids, **sd)
  """)
  subprocess.run([TORCHREC_PY, "-c", script], check=True, capture_output=True, timeout=600)
  ref = dict(np.load(tmp_path / "ref.npz"))
  cfg = get_config("tiny", d_model=D, bottom_mlp=(16,), top_mlp=(16, 12), dcn_layers=2,
                   dcn_rank=4)
  m = (DLRM if kind == "dot" else DCNv2)(cfg, SPEC, FD, rngs=nnx.Rngs(0))
  load_torchrec_state(m, ref)
  sparse = {f"f{i}": ref[f"sparse_arch.embedding_bag_collection.embedding_bags.t_{i}.weight"][
      ref["ids"][i]] for i in range(T)}
  y = m({"dense": ref["dense"], "sparse": sparse, "seq": {}, "domain": np.zeros(6, np.int32)})
  np.testing.assert_allclose(np.asarray(y), ref["out"], rtol=1e-5, atol=1e-6)


def test_student_teacher_embeddings_and_shared_modules():
  spec = reference_spec(n_dense=4, n_sparse=3, streams=1, max_len=6, item_features=1)
  fd = {f.name: 16 for f in spec.sparse}
  tcfg = get_config("tiny", d_model=16, num_blocks=1)
  teacher = GEM(tcfg, spec, fd, rngs=nnx.Rngs(0))
  x = random_inputs(spec, fd, 3)
  _, aux = nnx.jit(lambda t, x: t(x, return_aux=True))(teacher, x)
  scfg = get_config("tiny", d_model=16, num_blocks=2, wukong_nf=2, wukong_nl=2,
                    teacher_dim=aux["trunk"].shape[1])
  student = Student(scfg, spec, fd, rngs=nnx.Rngs(1),
                    shared={"dense_tok": teacher.dense_tok, "sparse_proj": teacher.sparse_proj})
  assert student.dense_tok is teacher.dense_tok  # parameter sharing by reference
  xs = dict(x, teacher_emb=aux["trunk"])
  fwd = nnx.jit(lambda s, x: s(x, return_aux=True))
  y, saux = fwd(student, xs)
  assert y.shape == (3, 2) and y.dtype == jnp.float32 and saux["trunk"].ndim == 2
  # the teacher embedding is an input: changing it changes the student's output
  y2, _ = fwd(student, dict(x, teacher_emb=aux["trunk"] + 1.0))
  assert float(jnp.max(jnp.abs(y2 - y))) > 1e-6
  g = nnx.jit(nnx.grad(lambda s: jnp.sum(s(xs) ** 2)))(student)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


# the backward's einsum (fp32; 20 tokens) and its unrolled form (bf16 with <= 16 tokens)
@pytest.mark.parametrize("n,dtype", [(5, "float32"), (20, "bfloat16"), (5, "bfloat16")])
def test_dot_pairs_matches_gather_and_autodiff(n, dtype):
  """dot_pairs (selection matmul, symmetric backward) = Z Z^T indexed, values and
  gradients, for DLRM's strict upper triangle and for pairs with i == j and repeats;
  bf16 against the fp32 reference on the same bf16 values, to bf16's rounding."""
  from gem_jax.layers.pairs import dot_pairs
  z = jnp.asarray(np.random.default_rng(0).normal(size=(32, n, 8)), dtype)
  tol = 1e-5 if dtype == "float32" else 2e-2
  iu = np.triu_indices(n, k=1)
  for rows, cols in [(iu[0], iu[1]), (np.array([0, 2, 2, 4, 1]), np.array([0, 3, 2, 1, 3]))]:
    rows, cols = tuple(int(i) for i in rows), tuple(int(j) for j in cols)
    ref = lambda z: jnp.einsum("bid,bjd->bij", z.astype(jnp.float32), z.astype(jnp.float32)
                               )[:, np.asarray(rows), np.asarray(cols)]
    np.testing.assert_allclose(dot_pairs(z, rows, cols), ref(z), rtol=tol / 10, atol=tol / 10)
    loss = lambda f: (lambda z: jnp.sum(jnp.sin(f(z))))
    got = jax.grad(loss(lambda z: dot_pairs(z, rows, cols)))(z)
    assert got.dtype == z.dtype
    np.testing.assert_allclose(got.astype(jnp.float32), jax.grad(loss(ref))(z).astype(jnp.float32),
                               rtol=tol, atol=tol)
