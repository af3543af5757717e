"""FLOPs of jagged histories: real tokens vs padded vs packed."""
import dataclasses

import numpy as np

from gem_jax import flops
from gem_jax.models.config import get_config, reference_spec


def test_real_token_flops_is_the_mean_over_examples():
  f = lambda n: flops.attention_flops(n, 8)  # noqa: E731
  lengths = [1, 3, 0, 10]
  assert flops.real_token_flops(lengths, f) == sum(f(n) for n in lengths) / 4
  # GEM.md 5: mean(L) for the linear terms, mean(L^2) for the scores.
  want = 8 * np.mean(lengths) * 64 + 4 * np.mean(np.square(lengths)) * 8
  assert abs(flops.real_token_flops(lengths, f) - want) < 1e-9
  assert flops.packed_flops(2, 10, 4, f) == 2 * f(10) / 4


def test_gem_flops_with_lengths():
  cfg = dataclasses.replace(get_config("tiny"), seq_layer="hstu")
  spec = reference_spec()
  fd = {f.name: cfg.d_model for f in spec.sparse}
  padded = flops.gem_flops(cfg, spec, fd)
  full = {s.name: [s.max_len] * 3 for s in spec.sequences}
  assert flops.gem_flops(cfg, spec, fd, lengths=full) == padded
  short = {s.name: [0, 5, 10 * s.max_len] for s in spec.sequences}  # longer: truncated
  real = flops.gem_flops(cfg, spec, fd, lengths=short)
  assert real["total"] < padded["total"]
  for key in ("dense_tokenizer", "trunk", "heads", "block0/wukong"):
    assert real[key] == padded[key]  # non-sequence terms do not depend on the lengths
  empty = flops.gem_flops(cfg, spec, fd, lengths={s.name: [0] for s in spec.sequences})
  assert empty["sequence_embedder"] == 0
  hstu = padded["block0/interformer"]
  attn = flops.gem_flops(dataclasses.replace(cfg, seq_layer="attention"), spec,
                         fd)["block0/interformer"]
  assert hstu > attn
