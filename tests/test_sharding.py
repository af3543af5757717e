"""Sharding rules: logical names -> mesh axes; dense params HSDP; optimizer state follows."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from gem_jax.layers.dense import Dense
from gem_jax.parallel import sharding as shd


@pytest.fixture(scope="module")
def mesh24():
  return make_mesh(2, 4)


@pytest.mark.parametrize("shape,axes,want", [
    ((256, 1024), ("embed", "mlp"), P(None, "shard")),     # largest divisible axis
    ((1024, 256), ("mlp", "embed"), P("shard", None)),
    ((1026, 256), ("mlp", "embed"), P(None, "shard")),     # 1026 % 4 != 0 -> next largest
    ((1026, 258), ("mlp", "embed"), P(None, None)),        # nothing divisible -> replicated
    ((4096, 8), ("embed", "tasks"), P("shard", None)),
    ((8, 4096), ("tasks", "mlp"), P(None, "shard")),
    ((4096,), ("norm",), P(None)),                          # rule None: never split
    ((64,), ("mlp",), P(None)),                             # below min_elements
    ((64, 64), (None, "my_new_axis"), P("shard", None)),   # unknown names are candidates
])
def test_dense_param_spec(mesh24, shape, axes, want):
  assert shd.dense_param_spec(shape, axes, mesh24) == want


def test_dense_param_spec_rank_mismatch(mesh24):
  with pytest.raises(ValueError, match="do not match"):
    shd.dense_param_spec((4, 4), ("embed",), mesh24)


def test_single_shard_mesh_replicates():
  assert shd.dense_param_spec((1024, 1024), ("embed", "mlp"), make_mesh(8, 1)) == P(None, None)


def test_batch_shardings(mesh24):
  assert shd.batch_sharding(mesh24).spec == P(("replica", "shard"))
  batch = {"dense": np.zeros((8, 3)), "ids": {"a": np.zeros((8, 2))}}
  ids_sh = {"a": shd.replicated(mesh24)}
  out = shd.batch_shardings(batch, mesh24, ids_sh)
  assert out["dense"].spec == P(("replica", "shard")) and out["ids"]["a"].spec == P()


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.a = Dense(16, 256, rngs=rngs)
    self.b = Dense(256, 3, rngs=rngs, kernel_axes=("mlp", "heads"))


def test_params_and_adam_state_placed_hsdp(mesh24):
  """Params are made by a jit with out_shardings; each device holds 1/4 of a.kernel,
  the two replicas hold the same quarters; Adam moments share the params' layout."""
  def init(key):
    return nnx.split(_Net(nnx.Rngs(key)), nnx.Param)[1]

  abstract = jax.eval_shape(init, jax.random.key(0))
  p_sh = shd.dense_param_shardings(abstract, mesh24)
  params = jax.jit(init, out_shardings=p_sh)(jax.random.key(0))
  kernel = params["a"]["kernel"][...]
  assert kernel.sharding.spec == P(None, "shard")
  assert {s.data.shape for s in kernel.addressable_shards} == {(16, 64)}
  by_index = {}
  for s in kernel.addressable_shards:
    by_index.setdefault(str(s.index), []).append(np.asarray(s.data))
  assert len(by_index) == 4 and all(len(v) == 2 for v in by_index.values())
  for a, b in by_index.values():
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.asarray(kernel), np.asarray(init(jax.random.key(0))["a"]["kernel"][...]))
  assert params["b"]["kernel"][...].sharding.spec == P(None, None)  # 768 < min_elements

  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  abstract_opt = jax.eval_shape(tx.init, abstract)
  o_sh = shd.optimizer_state_shardings(tx, abstract_opt, p_sh, mesh24)
  opt = jax.jit(tx.init, out_shardings=o_sh)(params)
  adam = opt[1][0]
  assert adam.mu["a"]["kernel"][...].sharding.spec == P(None, "shard")
  assert adam.nu["a"]["kernel"][...].sharding.spec == P(None, "shard")
  assert adam.count.sharding.spec == P()


def test_activations_keep_the_batch_split_under_activation_sharding(mesh24):
  """A Dense output follows the batch split, not its kernel's FSDP split ('shard' on N)."""
  layer = Dense(16, 256, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer, nnx.Param)
  params = jax.device_put(params, shd.dense_param_shardings(params, mesh24))
  assert params["kernel"][...].sharding.spec == P(None, "shard")
  x = jax.device_put(jnp.ones((32, 16)), shd.batch_sharding(mesh24))

  def apply(params, x, mesh):
    with shd.activation_sharding(mesh):
      return nnx.merge(graphdef, params)(x)

  y = jax.jit(lambda p, x: apply(p, x, mesh24))(params, x)
  assert y.sharding.spec == P(("replica", "shard"))
  np.testing.assert_allclose(np.asarray(y), np.asarray(layer(jnp.ones((32, 16)))), rtol=1e-6)
  assert jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x).sharding.spec != \
      P(("replica", "shard"))                   # what the pin changes
  assert shd.constrain_batch(x) is x            # outside the context: identity
