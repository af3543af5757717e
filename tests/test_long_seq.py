"""GEM with long-history options: the HSTU sequence layer and the chunked attention path
give the dense path's logits and gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gem_jax.models import GEM, get_config, random_inputs, reference_spec


@pytest.mark.slow  # two GEM compiles with gradients: ~1 min on 2 loaded cores
def test_gem_hstu_chunked_equals_dense():
  spec = reference_spec()
  base = dataclasses.replace(get_config("tiny"), seq_layer="hstu")
  dims = {f.name: base.d_model for f in spec.sparse}
  inputs = jax.tree.map(jnp.asarray, random_inputs(spec, dims, batch=4))
  out = {}
  for impl in ("dense", "chunked"):
    cfg = dataclasses.replace(base, attn_impl=impl, attn_chunk=16)
    model = GEM(cfg, spec, dims, rngs=nnx.Rngs(0))
    assert model.blocks[0].branches[0].hstu is not None

    def loss(m):
      return jnp.sum(jnp.sin(m(inputs)))

    out[impl] = nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)
  (ld, gd), (lc, gc) = out["dense"], out["chunked"]
  np.testing.assert_allclose(float(lc), float(ld), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gd)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
