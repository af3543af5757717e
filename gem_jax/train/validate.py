"""Start-up checks of a run: every one raises `ConfigError` before anything compiles.

A `ConfigError` is a one-line `config error: ...` from scripts/train.py (exit
status 1). Missing data files surface from `data.registry` (as a ConfigError
raised by `setup.setup`); a table over the memory budget from `setup.make_plan`.

  check_config(config, num_devices)        mesh vs devices, batch divisibility, steps
                                           or epochs, early stopping (check_stopping)
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
from gem_jax.parallel.mesh import resolve_mesh_shape
from gem_jax.train import metrics as metrics_lib


class ConfigError(ValueError):
  """A run-config problem found before anything compiles."""


def _fail(msg: str):
  raise ConfigError(msg)


def check_config(config, num_devices: int) -> tuple[int, int]:
  """Static checks of a run config; returns the resolved (replica, shard) mesh shape."""
  try:
    mesh_shape = resolve_mesh_shape(tuple(config.mesh), num_devices)
  except ValueError as e:
    hint = ("; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "(scripts/train.py sets 8)" if jax.default_backend() == "cpu" else "")
    raise ConfigError(f"config.mesh={tuple(config.mesh)}: {e}{hint}") from None
  n = math.prod(mesh_shape)
  b, k = config.data.batch_size, config.train.grad_accum
  if b % (n * jax.process_count()) or b % n:
    raise ConfigError(f"config.data.batch_size={b} must be divisible by the {n} devices of "
                      f"mesh {mesh_shape} (and by the {jax.process_count()} processes)")
  if k < 1 or (b // n) % k:
    raise ConfigError(f"config.train.grad_accum={k} must divide the per-device batch {b // n}")
  reduce_dtype = config.train.get("grad_reduce_dtype", "float32")
  if reduce_dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"config.train.grad_reduce_dtype={reduce_dtype!r}: float32 or bfloat16")
  if reduce_dtype == "bfloat16" and config.model.get("dtype", "float32") != "bfloat16":
    raise ConfigError(f"config.train.grad_reduce_dtype='bfloat16' needs "
                      f"config.model.dtype='bfloat16' (it is {config.model.get('dtype')!r}): the "
                      "weight gradients leave their dots in bf16 only in a bf16 backward")
  if config.data.eval_batch_size % n:
    raise ConfigError(f"config.data.eval_batch_size={config.data.eval_batch_size} must be "
                      f"divisible by the {n} devices")
  check_stopping(config.train)
  return mesh_shape


def check_stopping(train_cfg) -> None:
  """How long the run trains and when it stops early (rules: configs/base.py).

  steps >= 0, epochs >= 0, one of them > 0 (steps > 0 wins); early_stop_patience >= 0,
  and > 0 only with a best_metric that has a direction (`metrics.metric_mode`).
  The row count behind `epochs` is checked where the source exists (setup.resolve_steps).
  """
  steps, epochs = train_cfg.steps, float(train_cfg.epochs)
  if steps < 0:
    _fail(f"config.train.steps={steps} must be >= 1 (or 0: train.epochs passes)")
  if not epochs >= 0 or math.isinf(epochs):
    _fail(f"config.train.epochs={train_cfg.epochs} must be a finite number >= 0")
  if steps == 0 and epochs == 0:
    _fail("config.train.steps=0 and config.train.epochs=0: set train.steps (> 0) or "
          "train.epochs (> 0, with steps=0)")
  patience, metric = train_cfg.early_stop_patience, train_cfg.best_metric
  if patience < 0:
    _fail(f"config.train.early_stop_patience={patience} must be >= 0 (0: off)")
  if metric:
    try:
      metrics_lib.metric_mode(metric)
    except ValueError as e:
      _fail(f"config.train.best_metric={metric!r}: {e}")
  elif patience > 0:
    _fail(f"config.train.early_stop_patience={patience} watches config.train.best_metric, "
          "which is unset")


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
  if emb_cfg.lr is not None and not float(emb_cfg.lr) > 0:
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
