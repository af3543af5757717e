"""Start-up checks that need more than the config: the workdir and the tables.

Each raises the loop's `ConfigError` (a one-line `config error: ...` from
scripts/train.py, exit status 1) before anything is compiled or allocated.
The config-only checks (mesh vs devices, batch divisibility) live in
`loop.check_config`; missing data files surface from `data.registry`.

  check_workdir(workdir, need_bytes)       exists or can be created, is writable,
                                           has room for the checkpoints kept
  check_embedding(spec, emb_cfg, shared)   table/feature settings agree with the data
  checkpoint_bytes(abstract, keep)         what `check_workdir` should ask for
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any

import jax

from gem_jax.embedding import config as emb_config


def _fail(msg: str):
  from gem_jax.train.loop import ConfigError  # pylint: disable=import-outside-toplevel
  raise ConfigError(msg)


def _nbytes(x: Any) -> int:
  return math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize


def checkpoint_bytes(abstract_state: Any, keep: int) -> int:
  """Disk a run needs for its checkpoints: (keep + 2) x the state (kept ones, one being
  written, the best one), uncompressed (Orbax compresses little of fp32 state)."""
  return (int(keep) + 2) * sum(_nbytes(x) for x in jax.tree.leaves(abstract_state))


def check_workdir(workdir: str, need_bytes: int = 0) -> None:
  """The workdir exists (or is created), is a writable directory, and has `need_bytes` free."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    _fail(f"workdir {workdir!r} is not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    _fail(f"workdir {workdir!r} cannot be created: {e.strerror or e}")
  try:
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write_test_") as f:
      f.write(b"0" * 4096)
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    _fail(f"workdir {workdir!r} is not writable: {e.strerror or e}")
  free = shutil.disk_usage(workdir).free
  if need_bytes and free < need_bytes:
    _fail(f"workdir {workdir!r} has {free / 2**20:.1f} MiB free; the checkpoints kept "
          f"(train.keep) need about {need_bytes / 2**20:.1f} MiB")


def check_embedding(spec, emb_cfg, shared: dict | None = None) -> None:
  """Embedding settings vs the data's features.

  Checks: dim > 0; sharding, id_policy and optimizer names known; lr > 0;
  every sparse feature has a positive vocab and bag; a shared table names an
  existing feature that owns its table, and under id_policy='error' the
  sharing feature's vocab fits in the owner's rows.
  """
  if int(emb_cfg.dim) <= 0:
    _fail(f"config.embedding.dim={emb_cfg.dim} must be positive")
  for field, allowed in (("sharding", emb_config.SHARDING_TYPES),
                         ("id_policy", emb_config.ID_POLICIES),
                         ("optimizer", emb_config.OPTIMIZERS)):
    if emb_cfg[field] not in allowed:
      _fail(f"config.embedding.{field}={emb_cfg[field]!r}: expected one of {allowed}")
  if not float(emb_cfg.lr) > 0:
    _fail(f"config.embedding.lr={emb_cfg.lr} must be positive")
  feats = {f.name: f for f in spec.sparse}
  for f in spec.sparse:
    if f.vocab < 1 or f.bag < 1:
      _fail(f"feature {f.name!r}: vocab {f.vocab} and bag {f.bag} must be positive")
  for name, owner in (shared or {}).items():
    if name not in feats:
      _fail(f"shared table: feature {name!r} is not among the data's sparse features "
            f"{sorted(feats)}")
    if owner not in feats:
      _fail(f"shared table: feature {name!r} reads the table of {owner!r}, which is not "
            f"among the data's sparse features {sorted(feats)}")
    if (shared or {}).get(owner, owner) != owner:
      _fail(f"shared table: feature {name!r} reads the table of {owner!r}, which itself "
            f"reads {shared[owner]!r}; point it at the owner directly")
    if feats[name].vocab > feats[owner].vocab and emb_cfg.id_policy == "error":
      _fail(f"shared table: feature {name!r} (vocab {feats[name].vocab}) reads the table of "
            f"{owner!r} ({feats[owner].vocab} rows) with id_policy='error': its larger ids "
            f"would fail every batch; use 'hash' or 'clip', or share_tables=False")
