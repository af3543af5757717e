"""gem_jax.vma: a pmax over axes some of which the value is invariant along."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gem_jax import vma
from gem_jax.parallel.mesh import make_mesh


def test_pmax_of_a_shard_invariant_flag_over_both_axes():
  mesh = make_mesh((2, 4))
  x = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)   # device (r, s) holds 4 r + s

  def body(v):                                      # v: (1, 1)
    total = jax.lax.psum(v, "shard")                 # invariant along 'shard'
    before = vma.varying_axes(total)
    cast = vma.to_varying(total, ("replica", "shard"))
    assert "shard" not in before and vma.varying_axes(cast) >= {"replica", "shard"}
    return vma.pmax(total, ("replica", "shard"))

  out = jax.shard_map(body, mesh=mesh, in_specs=P("replica", "shard"),
                      out_specs=P("replica", "shard"))(x)
  # replica 0 sums 0+1+2+3 = 6, replica 1 sums 4+5+6+7 = 22: the max over all is 22
  np.testing.assert_array_equal(np.asarray(out), np.full((2, 4), 22))
