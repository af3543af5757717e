"""Ragged exchange of row-wise ids, rows and gradients: only the real ids travel.

The padded row-wise exchange (`exchange._rw_fetch_a2a`) sends a (S, C) buffer per
device, C per (source, owner) pair with head-room for the binomial spread of each
pair: at S = 256 and 512 distinct ids per device, C = 9 for ~2 real ids, so 2,304
slots leave each device for 512 ids. `jax.lax.ragged_all_to_all` sends each
owner's run of the sorted distinct rows as it is (the wire carries n ids, flat in
S) into a receive buffer of M slots per owner (`EmbeddingPlan.recv_capacity`),
whose head-room covers the spread of the *sum* over S sources: M ~ n + 4 sqrt(n).

Worked example (S = 3, rps = 4 rows per shard, device 1's distinct rows [0, 5, 9]
and device 0's [1, 2, 6, .]):
  device 1: start [0, 1, 2], count [1, 1, 1] (runs of owners 0, 1, 2 in its list)
  device 0: start [0, 2, 3], count [2, 1, 0]
  `all_to_all(count)`: owner 0 learns recv_count [2, 1, c2] (from sources 0, 1, 2),
  lays them end to end, recv_start [0, 2, 3], and `all_to_all(recv_start)` tells
  source 1 that its run lands at slot 2 of owner 0 (out_off[0] = 2).
  `ragged_all_to_all(local rows)`: owner 0's buffer (M,) = [1, 2 | 0 | ...] (rows
  1, 2 from device 0, row 0 from device 1); it gathers (M, D) and a second
  `ragged_all_to_all` sends slots [recv_start[i], + recv_count[i]) back to source i,
  at source i's own `start` (told by `all_to_all(start)`): device 1 receives w0 at
  position 0 of its (n, D) rows, aligned with its distinct list, no re-indexing.
The gradients of those rows go to the owners along the forward's routes.

XLA:CPU has no ragged-all-to-all; there `all_to_all` runs the same contract on
padded (S, K) blocks (`_padded_ragged_all_to_all`): the same offsets, sizes and
results, so the CPU tests check the offset arithmetic the GPU path runs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gem_jax import vma

NATIVE_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")   # backends with ragged-all-to-all


@dataclasses.dataclass(frozen=True)
class RaggedRoutes:
  """Per-device routes of one row-wise exchange over 'shard' (all int32 (S,)).

  start, count: each owner's run in my sorted distinct rows (requester side);
  out_off: where my run starts in each owner's receive buffer;
  recv_start, recv_count: each source's run in my receive buffer (owner side);
  back_off: where my reply to each source starts in its rows (= that source's start).
  """
  start: jax.Array
  count: jax.Array
  out_off: jax.Array
  recv_start: jax.Array
  recv_count: jax.Array
  back_off: jax.Array


def exclusive_cumsum(x):
  """[a, b, c] -> [0, a, a + b]: where runs of sizes x start when laid end to end."""
  return jnp.cumsum(x) - x


def routes(start, count, axis: str = "shard") -> RaggedRoutes:
  """Owner runs (start, count) of this device -> the routes of both directions.

  Two all_to_alls of 2 S and S int32 per device (flat in everything but S).
  """
  sc = jax.lax.all_to_all(jnp.stack([count, start], 1), axis, 0, 0, tiled=True)  # (S, 2)
  recv_count, back_off = sc[:, 0], sc[:, 1]
  recv_start = exclusive_cumsum(recv_count)
  out_off = jax.lax.all_to_all(recv_start, axis, 0, 0, tiled=True)
  return RaggedRoutes(start, count, out_off, recv_start, recv_count, back_off)


def _padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, *, axis_name: str, max_send: int):
  """`jax.lax.ragged_all_to_all` (one slice per peer) through a padded `all_to_all`.

  Slice i of `operand` (rows [input_offsets[i], + send_sizes[i])) is padded to
  `max_send` rows and sent to peer i, which writes it at the offset this device
  gave (`output_offsets[i]`, delivered by a second `all_to_all`). Requires
  send_sizes <= max_send; rows written past the end of `output` are dropped (the
  native op leaves that undefined; callers never do it).
  """
  j = jnp.arange(max_send, dtype=jnp.int32)
  n = operand.shape[0]
  idx = input_offsets[:, None] + j                                      # (S, K)
  send = jnp.take(operand, jnp.clip(idx, 0, n - 1), axis=0)             # (S, K, ...)
  recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)          # (S, K, ...) from i
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # (S,) my offsets
  pos = jnp.where(j < recv_sizes[:, None], at[:, None] + j, output.shape[0])  # (S, K)
  flat = recv.reshape((-1,) + recv.shape[2:])
  return output.at[pos.reshape(-1)].set(flat, mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name: str, native: bool, max_send: int):
  """`jax.lax.ragged_all_to_all` where the backend has it (`native`), else the padded
  equivalent with slices of at most `max_send` rows. Same arguments, same result."""
  if native:
    # inside shard_map the result takes `output`'s varying axes: give it the operand's
    output = vma.to_varying(output, sorted(vma.varying_axes(operand)))
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axis_name)
  return _padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                   recv_sizes, axis_name=axis_name, max_send=max_send)


def to_owners(r: RaggedRoutes, x, fill, recv_capacity: int, native: bool, axis: str = "shard"):
  """Requester rows x (n, ...) in owner runs -> each owner's receive buffer (M, ...),
  `fill` past the received runs."""
  out = jnp.full((recv_capacity,) + x.shape[1:], fill, x.dtype)
  return ragged_all_to_all(x, out, r.start, r.count, r.out_off, r.recv_count,
                           axis_name=axis, native=native,
                           max_send=min(x.shape[0], recv_capacity))


def to_requesters(r: RaggedRoutes, y, n: int, native: bool, axis: str = "shard"):
  """Owner replies y (M, ...) -> each requester's (n, ...) at the positions of its runs,
  zeros elsewhere (the reverse of `to_owners`)."""
  out = jnp.zeros((n,) + y.shape[1:], y.dtype)
  return ragged_all_to_all(y, out, r.recv_start, r.recv_count, r.back_off, r.count,
                           axis_name=axis, native=native, max_send=min(n, y.shape[0]))


def is_native(mesh) -> bool:
  """Do the devices of `mesh` run ragged-all-to-all (GPU, TPU; not XLA:CPU)? An
  AbstractMesh (no devices) is taken to be on this process's default backend."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.default_backend() in NATIVE_PLATFORMS
  return mesh.devices.flat[0].platform in NATIVE_PLATFORMS
