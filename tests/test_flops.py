"""Analytic FLOPs vs XLA's count, the wukong_108 CLI line, parameter counts."""
import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax import flops
from gem_jax.layers.mlp import MLP
from gem_jax.layers.wukong import WukongLayer
from gem_jax.models import DCNv2, DLRM, GEM, get_config, random_inputs, reference_spec


def _xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("overrides", [{}, dict(token_mix=False, wukong_fm="pairs"),
                                       dict(trunk_pairs=False)])
def test_tiny_gem_forward_flops_match_xla(overrides):
  spec = reference_spec(n_dense=5, n_sparse=4, streams=2, max_len=12, item_features=2)
  spec = dataclasses.replace(spec, sequences=(  # streams of 12 and 7 events: one branch each
      spec.sequences[0], dataclasses.replace(spec.sequences[1], max_len=7)))
  cfg = get_config("tiny", **overrides)
  fd = {f.name: (cfg.d_model if i % 2 else 8) for i, f in enumerate(spec.sparse)}
  model = nnx.eval_shape(lambda: GEM(cfg, spec, fd, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  b = 4
  xla = _xla_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, random_inputs(spec, fd, b)) / b
  ana = flops.gem_flops(cfg, spec, fd)
  assert abs(xla - ana["total"]) / ana["total"] < 0.10, (xla, ana)
  assert ana["total"] == sum(v for k, v in ana.items() if k != "total")
  # per-stream pyramid lengths (12, 6) and (7, 4): block 1 runs branches on 6 and 4 events
  assert ana["block1/interformer"] == flops.interformer_flops(cfg.n_interaction, [6, 4],
                                                              cfg.d_model)


def test_dlrm_flops_match_xla():
  spec = reference_spec(n_dense=13, n_sparse=8, streams=0)
  cfg = get_config("dlrm_torchrec")
  fd = {f.name: 64 for f in spec.sparse}
  model = nnx.eval_shape(lambda: DLRM(cfg, spec, fd, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  xla = _xla_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, random_inputs(spec, fd, 4)) / 4
  ana = flops.dlrm_flops(cfg, spec, fd)["total"]
  assert abs(xla - ana) / ana < 0.05, (xla, ana)


@pytest.mark.parametrize("rank,form", [(512, "product"), (64, "low_rank")])
def test_dcn_flops_match_xla_in_either_form(rank, form):
  """DCNv2 on the TorchRec shape (N = 9 x 64 = 576): rank 512 runs (W V) x, rank 64 W (V x).

  A large batch amortizes the product form's per-batch U = W V (2 N^2 r per layer),
  which the per-example count leaves out (1.5 % of it at this batch).
  """
  spec = reference_spec(n_dense=13, n_sparse=8, streams=0)
  cfg = get_config("dlrm_torchrec", dcn_layers=3, dcn_rank=rank)
  fd = {f.name: 64 for f in spec.sparse}
  model = nnx.eval_shape(lambda: DCNv2(cfg, spec, fd, rngs=nnx.Rngs(0)))
  assert model.crossnet.form == form
  graphdef, state = nnx.split(model)
  b = 32768
  xla = _xla_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, random_inputs(spec, fd, b)) / b
  ana = flops.dlrm_flops(cfg, spec, fd, "dcn")
  n = 9 * 64
  assert ana["interaction"] == 3 * (2 * n * n if form == "product" else 4 * n * rank)
  assert abs(xla - ana["total"]) / ana["total"] < 0.05, (xla, ana)


def test_formulas():
  assert flops.fm_flops(3, 4, 5) == 4 * 3 * 4 * 5
  assert flops.wukong_layer_flops(6, 8, 3, 3, 2, (10,)) == (
      4 * 6 * 8 * 2 + 2 * (12 * 10 + 10 * 24) + 2 * 3 * 6 * 8)  # no residual projection
  assert flops.wukong_layer_flops(5, 8, 3, 3, 2, (10,)) == (
      4 * 5 * 8 * 2 + 2 * (10 * 10 + 10 * 24) + 2 * 3 * 5 * 8 + 2 * 5 * 6 * 8)
  assert flops.attention_flops(128, 16, mask="block_local", block_size=64) == (
      8 * 128 * 256 + 4 * 128 * 64 * 16)
  assert flops.attention_flops(100, 16, mask="block_local", block_size=64) == (
      8 * 100 * 256 + 4 * 128 * 64 * 16)  # padded to whole blocks
  assert flops.train_flops(10) == 30


def test_wukong_108_cli_json_line():
  out = subprocess.run([sys.executable, "-m", "gem_jax.flops", "--preset", "wukong_108",
                        "--no-params"], capture_output=True, text=True, check=True, timeout=300)
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 1
  rec = json.loads(lines[0])
  assert 100 <= rec["train_gflops_per_example"] <= 116, rec
  np.testing.assert_allclose(rec["train_gflops_per_example"],
                             3 * rec["forward_gflops_per_example"], rtol=1e-12)


def test_count_params():
  m = MLP(3, [4, 2], rngs=nnx.Rngs(0))
  assert flops.count_params(m) == 3 * 4 + 4 + 4 * 2 + 2
  abstract = nnx.eval_shape(lambda: WukongLayer(6, 8, n_f=3, n_l=3, k=2, mlp_hidden=(10,),
                                                rngs=nnx.Rngs(0)))
  # Y (6x2) + LN(12) 2x12 + MLP 12x10+10 + 10x24+24 + LCB 3x6 + LN(8) 2x8
  assert flops.count_params(abstract) == 12 + 24 + 130 + 264 + 18 + 16


def test_gem_xl_preset_flops_match_xla():
  """configs/gem_xl.py, the GEM-class preset: the analytic forward and training FLOPs
  (3 x forward) against XLA's count of the lowered program (abstract parameters and
  batch: nothing is allocated or compiled), at the padded length the device computes
  without packing, fp32, dense attention (the chunked kernel's loop body would be counted
  once, not once per tile); both within 5 %."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "gem_xl.py")
  mod_spec = importlib.util.spec_from_file_location("gem_xl", path)
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  c = mod.get_config()
  spec = setup.sources(c)[0].spec
  dims = {f.name: c.embedding.dim for f in spec.sparse}
  cfg = dataclasses.replace(setup.model_config(c.model), seq_pack_tokens=0, seq_pack_rows=0,
                            dtype="float32", remat=None, attn_impl="dense")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GEM(cfg, spec, dims, rngs=nnx.Rngs(0))))
  b = 2
  x = jax.eval_shape(lambda: random_inputs(spec, dims, b))

  def forward(s, x):
    return nnx.merge(graphdef, s)(x)

  def loss(s, x):
    return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(forward(s, x)))

  def lowered_flops(fn):
    cost = jax.jit(fn).lower(state, x).cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"] / b

  fwd = flops.gem_flops(cfg, spec, dims)["total"]
  assert 14e9 < fwd < 15e9  # the preset's padded forward (docstring: 43.6 training GFLOPs)
  assert abs(lowered_flops(forward) - fwd) / fwd < 0.05
  assert abs(lowered_flops(jax.grad(loss)) - flops.train_flops(fwd)) / flops.train_flops(fwd) < 0.05
