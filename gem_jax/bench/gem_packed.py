"""GEM end to end, padded vs packed histories: one training step, side by side (issue 19).

The whole model (front end, InterFormer blocks with their pyramid, target attention,
trunk, heads) on `batch` users with one history stream of max_len L whose lengths are
log-normal (median, sigma) clipped to [0, L]:

  padded: every history padded to L (attention 'auto': chunked above attn_dense_max);
  packed: seq_pack_tokens = num_cls + L, seq_pack_rows = the rows first-fit decreasing
          needs for these lengths (gem_jax.data.packing.pack_plan), so no fallback.

Per mode: median step time (value_and_grad of a sum of the logits over every parameter,
after one warm-up), compiled temporaries, real events per step and real events/s, the
tokens the sequence arch computes on (B L padded; R T packed).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gem_jax.bench.timing import loadavg
from gem_jax.data.long_history import history_lengths
from gem_jax.data.packing import pack_plan
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec
from gem_jax.models import GEM, get_config, random_inputs

MODES = ("padded", "packed")


@dataclasses.dataclass(frozen=True)
class Setup:
  batch: int = 16
  max_len: int = 1024
  median: float = 300.0
  sigma: float = 1.0
  d_model: int = 32
  num_heads: int = 2
  preset: str = "tiny"
  repeats: int = 3
  seed: int = 0


def spec_for(s: Setup) -> DataSpec:
  return DataSpec(n_dense=4,
                  sparse=(SparseFeatureSpec("cand", 1000),
                          SparseFeatureSpec("item", 1000)),
                  sequences=(SequenceStreamSpec("hist", s.max_len, ("item",)),))


def run_one(s: Setup, mode: str, lengths: np.ndarray) -> dict:
  spec = spec_for(s)
  cfg = get_config(s.preset, d_model=s.d_model, num_heads=s.num_heads)
  rows = 0
  if mode == "packed":
    rows = pack_plan(lengths + cfg.num_cls, cfg.num_cls + s.max_len).rows
    cfg = dataclasses.replace(cfg, seq_pack_tokens=cfg.num_cls + s.max_len, seq_pack_rows=rows)
  dims = {f.name: cfg.d_model for f in spec.sparse}
  inputs = jax.tree.map(jnp.asarray, random_inputs(spec, dims, s.batch, seed=s.seed,
                                                   lengths={"hist": lengths}))
  model = GEM(cfg, spec, dims, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, inputs):
    return jax.value_and_grad(lambda st: jnp.sum(nnx.merge(graphdef, st)(inputs)))(state)

  compiled = step.lower(state, inputs).compile()
  mem = compiled.memory_analysis()
  jax.block_until_ready(compiled(state, inputs))
  times = []
  for _ in range(s.repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(state, inputs))
    times.append(time.perf_counter() - t0)
  real = int(lengths.sum())
  med = float(np.median(times))
  computed = rows * (cfg.num_cls + s.max_len) if mode == "packed" else s.batch * s.max_len
  return dict(mode=mode, L=s.max_len, batch=s.batch, step_s=round(med, 4),
              temp_mb=round(mem.temp_size_in_bytes / 2 ** 20, 1), real_events=real,
              real_events_per_s=round(real / med), computed_tokens=computed,
              load=loadavg())


def run(s: Setup, modes=MODES) -> list[dict]:
  rng = np.random.default_rng(s.seed)
  lengths = np.minimum(history_lengths(s.batch, s.median, s.sigma, s.max_len, rng), s.max_len)
  return [run_one(s, m, lengths) for m in modes]
