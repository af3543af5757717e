"""Random model inputs that follow the model input contract, for tests, demos and FLOPs.

  inputs = {
    'dense':  float32 (B, n_dense),
    'sparse': {feature: (B, D_f)},                       pooled features
    'seq':    {stream: {'items': {feature: (B, L, D_f)}, 'action': int32 (B, L),
                        'surface': int32 (B, L), 'dt': float32 (B, L), 'mask': bool (B, L)}},
    'domain': int32 (B,),
  }
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from gem_jax.data.spec import DataSpec


def random_inputs(spec: DataSpec, feature_dims: Mapping[str, int], batch: int, seed: int = 0,
                  lengths: Mapping[str, np.ndarray] | None = None) -> dict:
  """numpy inputs; per-stream lengths are random in [0, max_len] unless given.

  Padded events hold random values too (a valid model ignores them).
  """
  rng = np.random.default_rng(seed)
  f32 = np.float32
  out = {
      "dense": rng.normal(size=(batch, spec.n_dense)).astype(f32),
      "sparse": {f.name: rng.normal(size=(batch, feature_dims[f.name])).astype(f32)
                 for f in spec.pooled_features},
      "seq": {},
      "domain": rng.integers(0, max(spec.num_domains, 1), size=(batch,)).astype(np.int32),
  }
  for s in spec.sequences:
    L = s.max_len
    n = (np.asarray(lengths[s.name]) if lengths is not None
         else rng.integers(0, L + 1, size=(batch,)))
    out["seq"][s.name] = {
        "items": {f: rng.normal(size=(batch, L, feature_dims[f])).astype(f32)
                  for f in s.item_features},
        "action": rng.integers(0, s.num_actions, size=(batch, L)).astype(np.int32),
        "surface": rng.integers(0, s.num_surfaces, size=(batch, L)).astype(np.int32),
        "dt": rng.uniform(0, 1e6, size=(batch, L)).astype(f32),
        "mask": np.arange(L)[None, :] < n[:, None],
    }
  return out
