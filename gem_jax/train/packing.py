"""Packed histories in the trainer: the packed program where a batch fits, else the padded one.

With `model.overrides.seq_pack_tokens` > 0, GEM packs each batch shard's histories into
seq_pack_rows rows on device (gem_jax/layers/packed.py) and returns NaN logits for a
shard whose histories do not fit. The trainer never lets that happen: before each step
it runs the same first-fit-decreasing plan on the host for every batch shard (and
micro-batch) it holds, and steps a batch that does not fit with the padded program (the
same parameters, compiled on first use), so every step is exact:

  train_fn = PackedOrPadded(packed_fn, make_padded_fn, Fit.from_config(...))
  state, metrics = train_fn(state, batch)          # train_fn.fallbacks counts padded steps

Training batches are first reordered across this process's batch shards so that each
gets nearly the same number of events (`balanced`), which keeps the rows a shard needs
close to the mean.

An exact fallback inside one program (lax.cond) would keep the padded branch's buffers:
the compiled step's memory becomes the padded one's (measured in docs/PERFORMANCE.md),
which is what packing is for. Evaluation, prediction and export run the padded model
(`setup.setup` gives them its graphdef): exact for any batch, forward-only memory.

Multi-process: each process checks the shards it holds and the processes agree on the
program with one small all-gather per step (only when packing is on).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import numpy as np

from gem_jax.data.packing import balance, pack_plan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Fit:
  """The packing the model does: per stream, c CLS slots, T tokens a row, R rows a shard."""
  streams: tuple[str, ...]
  num_cls: int
  tokens: int
  rows: int
  grad_accum: int = 1

  @classmethod
  def from_config(cls, model_cfg, spec, grad_accum: int = 1) -> "Fit | None":
    """None unless the model packs (a GEM config with seq_pack_tokens > 0 and streams)."""
    if not getattr(model_cfg, "seq_pack_tokens", 0) or not spec.sequences:
      return None
    return cls(tuple(s.name for s in spec.sequences), model_cfg.num_cls,
               model_cfg.seq_pack_tokens, model_cfg.seq_pack_rows, grad_accum)

  def shard_fits(self, lengths: np.ndarray) -> bool:
    """One batch shard's lengths (N,): every micro-batch (rows i, i + k, ...) fits R rows."""
    k = self.grad_accum
    return all(pack_plan(lengths[i::k] + self.num_cls, self.tokens).rows <= self.rows
               for i in range(k))

  @staticmethod
  def shard_lengths(batch: dict, name: str) -> list[np.ndarray]:
    """Stream `name`'s lengths (N,) in each batch shard this process holds."""
    return [np.asarray(sh.data) for sh in batch["seq"][name]["len"].addressable_shards]

  def __call__(self, batch: dict) -> bool:
    """Whether every batch shard of this global device batch fits (all processes agree)."""
    ok = all(self.shard_fits(lengths)
             for name in self.streams for lengths in self.shard_lengths(batch, name))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      ok = bool(np.all(multihost_utils.process_allgather(np.array([ok]))))
    return ok


def balanced(fit: Fit, shards: int) -> Callable[[dict], dict]:
  """host batch -> the same rows reordered so that each of this process's `shards` batch
  shards gets as many histories and nearly as many events (`data.packing.balance`: event
  counts differ by at most the longest history; summed over the streams). The loss is a
  mean over rows, so the order changes no gradient; fewer batches fall back."""

  def reorder(batch: dict) -> dict:
    lengths = sum(np.asarray(batch["seq"][name]["len"], np.int64) for name in fit.streams)
    n = lengths.shape[0]
    perm = balance(lengths, shards)
    return jax.tree.map(lambda x: x[perm] if getattr(x, "shape", ())[:1] == (n,) else x,
                        batch)
  return reorder


class PackedOrPadded:
  """(state, batch) -> the packed step where `fits(batch)`, else the padded step."""

  def __init__(self, packed: Callable, make_padded: Callable[[], Callable], fits: Fit):
    self.packed, self.make_padded, self.fits = packed, make_padded, fits
    self.padded: Any = None
    self.fallbacks = 0

  def __call__(self, state, batch):
    if self.fits(batch):
      return self.packed(state, batch)
    if self.padded is None:
      log.warning("a batch's histories do not fit seq_pack_rows=%d packed rows of %d tokens "
                  "in a batch shard: stepping it padded (compiling the padded step once); "
                  "raise model.overrides.seq_pack_rows if this is frequent",
                  self.fits.rows, self.fits.tokens)
      self.padded = self.make_padded()
    self.fallbacks += 1
    return self.padded(state, batch)
