"""The MFU ceiling a program's matmul shapes allow: every dot of the step, timed alone.

  dots = collect_dots(jax.make_jaxpr(step_fn)(*args))     # {DotShape: count per call}
  c = ceiling(dots, model_flops=flops_per_example * batch, peak=probe)

A step cannot run faster than its matmuls: if each `dot_general` of the traced
program (forward and backward, inside `jit`, `shard_map`, `custom_vjp`, `remat`
and `scan` bodies) is compiled and timed on its own, with its inputs already in
cache, the sum over the step,

  T_dots = sum_s count_s x t_s,

is a lower bound on the step time of any schedule that keeps those shapes, and

  MFU_ceiling = model_flops / T_dots / peak

is an upper bound on the MFU of the step: every non-matmul op (gathers,
elementwise, layout copies, optimizer) costs extra. When the ceiling is below a
target, no scheduling or fusion work on the rest of the step reaches it; only
other shapes (wider layers, bigger batches per dot) or faster matmul kernels can.

The dots are the ones JAX emits (`jax.make_jaxpr`), before XLA's rewrites:
XLA may merge, split or turn small dots into elementwise code, so the
ceiling describes the shapes the model asks for.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class DotShape:
  """One distinct `dot_general`: operand shapes/dtypes, dimension numbers, result dtype."""
  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  lhs_dtype: str
  rhs_dtype: str
  dimension_numbers: tuple
  out_dtype: str | None

  @property
  def flops(self) -> int:
    """2 x batch x M x N x K: every output element is a K-long multiply-add."""
    (lc, _), (lb, _) = self.dimension_numbers
    contract = math.prod(self.lhs[d] for d in lc)
    batch = math.prod(self.lhs[d] for d in lb)
    free_l = math.prod(self.lhs) // (contract * batch)
    rc = self.dimension_numbers[0][1]
    rb = self.dimension_numbers[1][1]
    free_r = math.prod(self.rhs) // (math.prod(self.rhs[d] for d in rc) *
                                     math.prod(self.rhs[d] for d in rb))
    return 2 * batch * free_l * free_r * contract

  def as_dict(self) -> dict[str, Any]:
    """JSON form (benchmarks/torchrec/matmul.py reads it): shapes, dimension numbers, dtype.

    `dtype` is the operands' dtype, None when they differ (no like-for-like peer dot).
    """
    (lc, rc), (lb, rb) = self.dimension_numbers
    return {"lhs": list(self.lhs), "rhs": list(self.rhs),
            "contract": [list(lc), list(rc)], "batch": [list(lb), list(rb)],
            "dtype": self.lhs_dtype if self.lhs_dtype == self.rhs_dtype else None,
            "flops": self.flops, "shape": self.describe()}

  def describe(self) -> str:
    """'(17408, 32) x (32, 96) f32, contract (1,)x(0,)'."""
    (lc, rc), (lb, rb) = self.dimension_numbers
    dt = (self.lhs_dtype if self.lhs_dtype == self.rhs_dtype
          else f"{self.lhs_dtype}x{self.rhs_dtype}")
    batch = f", batch {tuple(lb)}x{tuple(rb)}" if lb else ""
    return f"{self.lhs} x {self.rhs} {dt}, contract {tuple(lc)}x{tuple(rc)}{batch}"


# ------------------------------------------------------------------ collect --

def _sub_jaxprs(params: dict[str, Any]) -> Iterable[Any]:
  """Jaxprs held in an equation's parameters (call bodies, branches, custom rules)."""
  for v in params.values():
    for item in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(item, "jaxpr", None)
      if inner is not None and hasattr(inner, "eqns"):   # ClosedJaxpr
        yield inner
      elif hasattr(item, "eqns"):                         # Jaxpr
        yield item


def collect_dots(jaxpr, times: int = 1, out: Counter | None = None) -> Counter:
  """Counts every dot_general of `jaxpr` (a Jaxpr or ClosedJaxpr) by `DotShape`.

  A `scan` body counts `length` times; both branches of a `cond` count (an
  over-estimate where only one runs); `while` bodies count once (trip count
  unknown at trace time). Under differentiation the backward's dots, custom
  VJP rules included, are part of the traced program.
  """
  out = Counter() if out is None else out
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars)
      pet = eqn.params.get("preferred_element_type")
      dn = eqn.params["dimension_numbers"]
      key = DotShape(tuple(lhs.shape), tuple(rhs.shape), str(lhs.dtype), str(rhs.dtype),
                     (tuple(map(tuple, dn[0])), tuple(map(tuple, dn[1]))),
                     None if pet is None else str(jnp.dtype(pet)))
      out[key] += times
      continue
    reps = times * int(eqn.params.get("length", 1)) if name == "scan" else times
    for sub in _sub_jaxprs(eqn.params):
      collect_dots(sub, reps, out)
  return out


# --------------------------------------------------------------------- time --

def _median_call_s(f, args, repeats: int, min_seconds: float) -> float:
  """Median seconds per call of `f(*args)`, calls dispatched back to back."""
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  once = time.perf_counter() - t0
  inner = max(1, int(min_seconds / max(once, 1e-7)))   # batch tiny calls per sample
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(inner):
      r = f(*args)
    jax.block_until_ready(r)
    samples.append((time.perf_counter() - t0) / inner)
  return float(np.median(samples))


def time_dot(shape: DotShape, repeats: int = 7, min_seconds: float = 0.02) -> float:
  """Seconds of one `lax.dot_general` of `shape`, inputs resident, call overhead removed.

  A jitted call costs a dispatch that the dot inside a compiled step does not
  pay: the median time of a jitted no-op on the same arguments is subtracted
  (floored at 1 ns), so tiny dots are not charged microseconds of overhead.
  """
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, shape.lhs, jnp.float32).astype(shape.lhs_dtype)
  b = jax.random.normal(k2, shape.rhs, jnp.float32).astype(shape.rhs_dtype)
  pet = None if shape.out_dtype is None else jnp.dtype(shape.out_dtype)
  dot = jax.jit(lambda x, y: lax.dot_general(x, y, shape.dimension_numbers,
                                             preferred_element_type=pet))
  noop = jax.jit(lambda x, y: x.reshape(-1)[0] + y.reshape(-1)[0])
  t_dot = _median_call_s(dot, (a, b), repeats, min_seconds)
  t_noop = _median_call_s(noop, (a, b), repeats, min_seconds)
  return max(t_dot - t_noop, 1e-9)


@dataclasses.dataclass(frozen=True)
class DotTiming:
  shape: DotShape
  count: int
  seconds: float          # one call

  @property
  def total_s(self) -> float:
    return self.count * self.seconds

  @property
  def flops_per_s(self) -> float:
    return self.shape.flops / self.seconds


def ceiling(dots: Counter, model_flops: float, peak: float, repeats: int = 7
            ) -> dict[str, Any]:
  """Times every distinct dot once; returns the lower-bound step time and MFU ceiling.

  model_flops: the analytic FLOPs of one step (the MFU numerator); peak: FLOP/s of
  the device (the MFU denominator). Fields: dot_ms (T_dots), dot_flops (what the
  dots compute, from their shapes), dot_efficiency (dot FLOP/s over the peak) and
  mfu_ceiling = model_flops / T_dots / peak; `timings` sorted by total time.
  """
  timings = sorted((DotTiming(s, c, time_dot(s, repeats)) for s, c in dots.items()),
                   key=lambda t: -t.total_s)
  total_s = sum(t.total_s for t in timings)
  dot_flops = sum(t.count * t.shape.flops for t in timings)
  return {"dot_count": sum(dots.values()), "dot_shapes": len(dots),
          "dot_ms": 1e3 * total_s, "dot_flops": dot_flops,
          "dot_efficiency": dot_flops / total_s / peak if total_s else float("nan"),
          "mfu_ceiling": model_flops / total_s / peak if total_s else float("nan"),
          "timings": timings}

