"""The collectives of a partitioned program (gem_jax/bench/collectives.py): the parser on a
written program, and what the SPMD partitioner makes of the train step's dense parameters."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import make_mesh
from gem_jax.bench import collectives, runner
from gem_jax.layers import dense
from gem_jax.train import setup as setup_lib
from gem_jax.train.validate import ConfigError

HLO = """HloModule m, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], bf16[4,8])) -> pred[] {
  %p = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]{1,0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[16,8]{1,0} all-gather(bf16[4,8]{1,0} %x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/dot_general"}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %x)
}

ENTRY %main () -> f32[] {
  %z = bf16[4,8]{1,0} constant({...})
  %i0 = s32[] constant(0)
  %t = (s32[], bf16[4,8]{1,0}) tuple(%i0, %z)
  %w = (s32[], bf16[4,8]{1,0}) while(%t), condition=%cond, body=%body
  %c = f32[4,8]{1,0} constant({...})
  %ar = (f32[4,8]{1,0}, f32[2]{0}) all-reduce(%c, %c), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  %rs = f32[1,8]{1,0} reduce-scatter(f32[4,8]{1,0} %c), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/shard_map/reduce_scatter"}
  ROOT %r = f32[] constant(0)
}
"""


def test_parse_reads_kinds_dtypes_groups_and_loop_runs():
  got = {c.kind: c for c in collectives.parse(HLO, 8)}
  ag, ar, rs = got["all-gather"], got["all-reduce"], got["reduce-scatter"]
  # inside a scan of 3 steps: 16 x 8 bf16 gathered 3 times, over groups of 4
  assert (ag.dtype, ag.nbytes, ag.group, ag.runs, ag.explicit) == ("bf16", 256, 4, 3, False)
  # a tuple's buffers summed: (32 + 2) x 4 bytes, groups of 2 listed by hand
  assert (ar.dtype, ar.nbytes, ar.group, ar.runs) == ("f32", 136, 2, 1)
  # reduce-scatter: the operand, result x group; written in shard_map: explicit
  assert (rs.nbytes, rs.group, rs.explicit) == (128, 4, True)
  sync = collectives.dense_sync(list(got.values()), dense_params=64, replicas=2, shards=4)
  assert sync == {"gather_bytes": 3 * 256 / 64, "grad_bytes": 0.0,
                  "replica_grad_bytes": 136 * 4 / 64, "other_bytes": 0.0}
  with pytest.raises(ValueError, match="must differ"):
    collectives.dense_sync([], 64, 4, 4)


def _sharded_params(config) -> tuple[int, int]:
  """(dense parameters, those split over 'shard') of `config` on its mesh."""
  s = setup_lib.setup(config)
  total = sharded = 0
  for x, sh in zip(jax.tree.leaves(s.abstract.params), jax.tree.leaves(s.shardings.params)):
    total += math.prod(x.shape)
    sharded += math.prod(x.shape) if any(a is not None for a in sh.spec) else 0
  return total, sharded


@pytest.mark.parametrize("dtype,width", [("bfloat16", 2), ("float32", 4)])
def test_each_sharded_weight_is_gathered_once_in_the_compute_dtype(dtype, width):
  """What the scale projection now reads from the program (network.StepVolumes), checked
  against the state on a model whose weights all feed matmuls (DLRM): without remat, one
  gather per sharded weight and step, in the compute dtype (the backward reuses it),
  gradients reduced in fp32 over 'shard', then the shard's over 'replica'. The network
  model had assumed two fp32 gathers (8 bytes per parameter). (GEM's `small` in bf16:
  1.92 bytes; one lookup table, the domain embedding, is gathered in fp32 for its `take`.)"""
  config = runner.load_config("tiny", {"mesh": (2, 4), "model.dtype": dtype,
                                      "model.name": "dlrm"})  # every weight feeds a matmul
  total, sharded = _sharded_params(config)
  assert sharded > 0.9 * total
  sync = collectives.train_step_sync(config)
  assert sync["dense_params"] == total
  assert sync["gather_bytes"] * total == pytest.approx(width * sharded, rel=1e-9)
  assert sync["grad_bytes"] == pytest.approx(4.0, abs=0.05)
  assert sync["replica_grad_bytes"] * total == pytest.approx(4 * sharded, rel=1e-9)


def test_gradient_accumulation_reduces_across_replicas_once_per_step():
  """grad_accum=k loops over the micro-batches: each gathers the weights and reduces its
  gradient over 'shard' (k x both), but the reduction across replicas (between nodes at
  scale) runs once, after the loop (per-replica accumulators, train/step.py); it had run
  per micro-batch (7.7 instead of 3.85 bytes per parameter at k = 2). It grows only by the
  replicated small weights, whose gradients now cross replicas there, not the whole mesh."""
  def sync(k):
    return collectives.train_step_sync(runner.load_config(
        "tiny", {"mesh": (2, 4), "train.grad_accum": k}))
  one, two = sync(1), sync(2)
  assert 1.9 < two["gather_bytes"] / one["gather_bytes"] < 2.1
  assert 1.9 < two["grad_bytes"] / one["grad_bytes"] < 2.1
  assert two["replica_grad_bytes"] / one["replica_grad_bytes"] < 1.2


def test_gem_step_partitions_without_replicating_token_gradients(capfd):
  """GEM's per-token lookup tables (action, surface, time, domain, CLS) are kept whole
  (logical axis 'lookup'): split on d, their gradients' scatter-add made the SPMD
  partitioner replicate the (B, L, d) token gradients, warning "Involuntary full
  rematerialization" (once in tiny's step on 2x4, five times in gem_xl's)."""
  sync = collectives.train_step_sync(runner.load_config("tiny", {"mesh": (2, 4)}))
  assert sync["gather_bytes"] > 0
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def _weight_grad(reduce_dtype, row_major: bool):
  """jit of dL/dw for L = sum((x w)^2) in bf16 through `dense.matmul`, the context set
  inside the traced function (as `step.loss_grads` does)."""
  def loss(w, x):
    with dense.weight_grad_dtype(reduce_dtype), dense.row_major_backward(row_major):
      return jnp.sum(jnp.square(dense.matmul(x, w, jnp.bfloat16)))
  return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("row_major", [False, True])   # GPU/TPU form; XLA:CPU's bf16 form
def test_weight_gradients_reduced_in_bf16_when_asked(row_major):
  """`dense.weight_grad_dtype(bf16)` (the trainer's `train.grad_reduce_dtype`): dW leaves
  its dot in bf16, so the reductions XLA's partitioner puts after it (x split over the
  batch of a 2 x 4 mesh, w over 'shard') move bf16, where they moved fp32; the gradient
  stays within bf16 rounding of the fp32 reduction's (each device's partial sum over its
  8 rows rounded once, then summed over 8 devices)."""
  mesh = make_mesh(2, 4)
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.normal(size=(64, 32)).astype(np.float32),
                     NamedSharding(mesh, P(("replica", "shard"), None)))
  w = jax.device_put(rng.normal(size=(32, 16)).astype(np.float32) / 4,
                     NamedSharding(mesh, P("shard", None)))
  got = {}
  for dt in (None, jnp.bfloat16):
    fn = _weight_grad(dt, row_major)
    got[dt] = np.asarray(fn(w, x))
    reductions = {c.dtype for c in collectives.parse(collectives.partitioned_hlo(
        fn.lower(w, x)), 8) if c.kind in ("all-reduce", "reduce-scatter")}
    assert reductions == ({"bf16"} if dt else {"f32"}), (dt, reductions)
  scale = np.abs(got[None]).max()
  np.testing.assert_allclose(got[jnp.bfloat16], got[None], atol=2 ** -6 * scale)
  assert not np.array_equal(got[jnp.bfloat16], got[None])


def test_bf16_gradient_reduction_halves_the_step_gradient_bytes():
  """GEM tiny in bf16 on 2 x 4, `train.grad_reduce_dtype='bfloat16'`: the gradient bytes
  the compiled step reduces over 'shard' and across replicas (also the per-replica
  accumulator's single sum with grad_accum = 2) fall to about half of fp32's; the rest are
  the small weights outside matmuls (norms, biases), still fp32."""
  def sync(**kw):
    return collectives.train_step_sync(runner.load_config(
        "tiny", {"mesh": (2, 4), "model.dtype": "bfloat16", **kw}))
  fp32, bf16 = sync(), sync(**{"train.grad_reduce_dtype": "bfloat16"})
  assert bf16["gather_bytes"] == fp32["gather_bytes"]
  assert 0.45 < bf16["grad_bytes"] / fp32["grad_bytes"] < 0.6
  assert 0.45 < bf16["replica_grad_bytes"] / fp32["replica_grad_bytes"] < 0.6
  acc = sync(**{"train.grad_reduce_dtype": "bfloat16", "train.grad_accum": 2})
  assert 0.45 < acc["replica_grad_bytes"] / fp32["replica_grad_bytes"] < 0.6


def test_bf16_gradient_reduction_needs_a_bf16_backward():
  config = runner.load_config("tiny", {"mesh": (2, 4),
                                       "train.grad_reduce_dtype": "bfloat16"})
  with pytest.raises(ConfigError, match="needs config.model.dtype='bfloat16'"):
    setup_lib.setup(config)
  config.train.grad_reduce_dtype = "float16"
  with pytest.raises(ConfigError, match="float32 or bfloat16"):
    setup_lib.setup(config)
