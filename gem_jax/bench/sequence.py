"""Long-history sequence stack benchmark: padded-dense vs chunked vs packed (issue 19).

One training step (forward + backward of every parameter and of the input tokens) of a
stack of sequence layers (`HSTUBlock`s or transformer `SequenceBlock`s, causal, time bias)
on the histories of `batch` users whose lengths are log-normal (median `median`, sigma
`sigma`), truncated to the most recent L events:

  dense:   padded (batch, L) rows, (L, L) scores (AttentionImpl 'dense');
  chunked: the same padded rows, chunked attention (memory linear in L);
  packed:  the same histories packed into R rows of L tokens (`gem_jax.data.packing`),
           chunked attention masked to each history's segment (layer='hstu' only: the
           transformer block takes no segment ids).

Per (L, mode): median step time over `repeats` timed steps (after one warm-up), the
compiled memory analysis (temporaries, arguments + outputs), real tokens per step (sum of
the truncated lengths), real-token throughput, and the tokens the device computes on.
A mode whose compiled temporaries exceed `max_run_gb` is compiled (memory figure) but not
run.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.bench.timing import loadavg
from gem_jax.data.long_history import history_lengths
from gem_jax.data.packing import pack_plan, truncate
from gem_jax.layers.attention import AttentionImpl
from gem_jax.layers.sequence import make_block

MODES = ("dense", "chunked", "packed")


@dataclasses.dataclass(frozen=True)
class Setup:
  batch: int = 8
  d_model: int = 64
  num_heads: int = 2
  layers: int = 1
  layer: str = "hstu"
  chunk: int = 256
  median: float = 300.0
  sigma: float = 1.0
  max_history: int = 4096
  repeats: int = 3
  max_run_gb: float = 6.0
  seed: int = 0


class Stack(nnx.Module):
  """`layers` sequence blocks on (rows, T, D) tokens with segments for packed rows."""

  def __init__(self, s: Setup, impl: AttentionImpl, norm_len: int, *, rngs: nnx.Rngs):
    kw = dict(mask="causal", time_buckets=16, impl=impl)
    if s.layer == "hstu":
      kw.update(norm_len=norm_len, pos_buckets=64)
    self.layer = s.layer
    self.blocks = nnx.List([make_block(s.layer, s.d_model, s.num_heads, 2, rngs=rngs, **kw)
                            for _ in range(s.layers)])

  def __call__(self, x, valid, dt, seg=None, pos=None):
    for b in self.blocks:
      if self.layer == "hstu":
        x = b.layer(x, valid, dt, seg=seg, pos=pos)  # (rows, T, D)
      else:
        x = b(x, valid, dt)
    return x


def _step_fn(graphdef):
  def loss(state, x, valid, dt, seg, pos):
    y = nnx.merge(graphdef, state)(x, valid, dt, seg, pos)
    return jnp.sum(jnp.where(valid[..., None], y, 0.0) ** 2) / jnp.maximum(valid.sum(), 1)

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _inputs(s: Setup, lengths: np.ndarray, L: int, mode: str, rng):
  """(x, valid, dt, seg, pos) and the number of rows for one mode."""
  n = len(lengths)
  if mode == "packed":
    plan = pack_plan(lengths, L)
    rows, valid = plan.rows, plan.valid
    seg, pos = jnp.asarray(plan.seg), jnp.asarray(plan.pos)
  else:
    rows = n
    valid = np.arange(L)[None, :] < lengths[:, None]
    seg = pos = None
  x = jnp.asarray(rng.standard_normal((rows, L, s.d_model), np.float32))
  dt = jnp.asarray(np.cumsum(rng.exponential(3600.0, (rows, L)), axis=1).astype(np.float32))
  return (x, jnp.asarray(valid), dt, seg, pos), rows


def run_one(s: Setup, L: int, mode: str, lengths: np.ndarray) -> dict:
  """One (L, mode) measurement (module docstring)."""
  if mode == "packed" and s.layer != "hstu":
    raise ValueError("packed rows need segment masks: only layer='hstu' takes them here")
  rng = np.random.default_rng(s.seed + 1)
  impl = AttentionImpl("dense" if mode == "dense" else "chunked", chunk_size=s.chunk)
  model = Stack(s, impl, L, rngs=nnx.Rngs(s.seed))
  graphdef, state = nnx.split(model)
  args, rows = _inputs(s, lengths, L, mode, rng)
  step = _step_fn(graphdef)
  t0 = time.perf_counter()
  compiled = step.lower(state, *args).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp = mem.temp_size_in_bytes
  io = mem.argument_size_in_bytes + mem.output_size_in_bytes
  real = int(lengths.sum())
  row = {"L": L, "mode": mode, "layer": s.layer, "batch": len(lengths), "rows": rows,
         "real_tokens": real, "computed_tokens": rows * L, "fill": real / (rows * L),
         "temp_mb": temp / 2 ** 20, "args_out_mb": io / 2 ** 20, "compile_s": compile_s}
  if temp > s.max_run_gb * 2 ** 30:
    row["skipped"] = f"temporaries {temp / 2 ** 30:.1f} GB > max_run_gb {s.max_run_gb}"
    return row
  jax.block_until_ready(compiled(state, *args))  # warm-up
  times = []
  for _ in range(s.repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(state, *args))
    times.append(time.perf_counter() - t0)
  med = float(np.median(times))
  row.update(step_ms_median=1e3 * med, step_ms_min=1e3 * min(times),
             step_ms_max=1e3 * max(times), real_tokens_per_s=real / med, loadavg=loadavg())
  return row


def run(s: Setup, lengths_L: Iterable[int], modes: Iterable[str] = MODES):
  """Yields one row per (L, mode); the same users' histories at every L (truncated to L)."""
  rng = np.random.default_rng(s.seed)
  full = history_lengths(s.batch, s.median, s.sigma, s.max_history, rng)
  for L in lengths_L:
    lengths, cut = truncate(full, L)
    for mode in modes:
      row = run_one(s, L, mode, lengths)
      row.update(truncated_histories=cut.histories, truncated_events=cut.events)
      yield row


def ratios(rows: list[dict], a: int, b: int) -> dict:
  """Per mode: temporaries at L=b / at L=a (the linear-memory target at b = 4a: <= 4.5)."""
  out = {}
  for mode in MODES:
    t = {r["L"]: r["temp_mb"] for r in rows if r["mode"] == mode}
    if a in t and b in t and t[a] > 0:
      out[mode] = t[b] / t[a]
  return out
