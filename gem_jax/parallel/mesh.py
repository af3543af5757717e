"""Device meshes for gem_jax.

One mesh, axes ('replica', 'shard') (GEM's HSDP + 2-D sparse parallelism):
batch over both axes, dense parameters sharded over 'shard' and replicated over
'replica', embedding tables split over 'shard' and replicated over 'replica'.

Axis types are `Auto` on purpose: sharding is given at the jit boundary
(in/out shardings) and inside `jax.shard_map` for the embedding exchanges, and
the dense model code needs no `out_sharding=` annotations, so every layer also
runs unchanged in a plain single-device `jax.jit`.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("replica", "shard")


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills in one -1 entry of `shape` so that the product equals `num_devices`.

  >>> resolve_mesh_shape((2, -1), 8)
  (2, 4)
  """
  shape = tuple(int(s) for s in shape)
  if sum(s == -1 for s in shape) > 1:
    raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
  if any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape {shape}: sizes must be positive or -1")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(
          f"mesh shape {shape}: {num_devices} devices are not divisible by {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) > num_devices:
    raise ValueError(
        f"mesh shape {shape} needs {math.prod(shape)} devices but only "
        f"{num_devices} are available ({jax.default_backend()})")
  return shape


def make_mesh(shape: Sequence[int] = (1, -1), devices=None) -> Mesh:
  """A ('replica', 'shard') mesh; `shape` may hold one -1.

  With fewer requested devices than available, the first ones are used (tests
  carve 1x2, 2x2 ... meshes out of 8 simulated CPU devices).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(shape, len(devices))
  n = math.prod(shape)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape),
                       devices=devices[:n])
