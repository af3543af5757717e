"""Collectives on values whose varying axes differ, inside `shard_map`.

Inside `shard_map` every value has a type-level set of mesh axes along which it varies
(its vma). A `psum` over 'shard' returns a value invariant along 'shard'; newer jax
(0.11) then refuses a `pmax` over ('replica', 'shard') of it, since the reduction mixes a
varying and an invariant axis. `pmax` here casts the missing axes to varying first (the
value is the same along them, so the result is unchanged): e.g. on a (2, 4) mesh a flag
psum'd over 'shard' is (replica-varying, shard-invariant); cast, then reduced over both,
it is the same on all 8 devices.
"""
from __future__ import annotations

import jax


def varying_axes(x) -> set:
  """The shard_map axes along which x varies (its type's vma; `.mat` in jax 0.10)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def to_varying(x, axes):
  """x cast to vary along every axis of `axes` (a no-op for those it varies along)."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def pmax(x, axes):
  """`jax.lax.pmax` over `axes`, whatever subset of them x varies along."""
  return jax.lax.pmax(to_varying(x, axes), axes)
