"""The collectives of a compiled step, read from its program after SPMD partitioning.

What a sharded train step moves between devices is decided by the compiler: the SPMD
partitioner inserts the all-gathers of FSDP-split parameters and the reductions of
their gradients (in whatever dtype the op next to them has: a bf16 model gathers its
weights after the cast), next to the collectives the code writes itself (the embedding
exchange in `shard_map`). `partitioned_hlo` returns the program as the partitioner left
it, before the backend's own passes (XLA:CPU widens bf16 collectives to fp32 later, a
GPU does not), and `parse` lists its collectives:

  kind            bytes (X, as in gem_jax.bench.network)
  all-gather      the gathered result (the full buffer)
  all-reduce      the buffer
  reduce-scatter  the operand (result x group size)
  all-to-all      what one device holds (the result)

`dense_sync` turns them into the bytes per dense parameter and step that
`network.StepVolumes` takes, so a projection uses the program's HSDP volumes, not
assumed ones. Example: `small` in bf16 on a (2, 4) CPU mesh gathers 1.9 bytes per
parameter per step (each sharded weight once, in bf16; the backward reuses it) where
the network model had assumed 8 (two fp32 gathers), and reduces its gradients in fp32
(4.0 bytes per parameter over 'shard', then 4 / S over 'replica', as modelled).
"""
from __future__ import annotations

import copy
import glob
import math
import os
import re
import tempfile
from typing import Any, NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache

from gem_jax.bench import runner
from gem_jax.layers import dense
from gem_jax.train import setup as setup_lib
from gem_jax.train import step as step_lib

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")
# Collectives written in the code (shard_map) carry the primitive's name as their op name.
EXPLICIT = frozenset({"all_gather", "all_gather_invariant", "all_to_all", "ragged_all_to_all",
                      "psum", "psum_scatter", "reduce_scatter", "pmax", "pmin", "ppermute"})
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(KINDS) + r")(-start)?\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


class Collective(NamedTuple):
  kind: str
  dtype: str
  nbytes: int       # X of the module docstring, per execution
  group: int        # devices per replica group
  explicit: bool    # written in the code (shard_map), not inserted by the partitioner
  op_name: str
  runs: int = 1     # executions per step (inside a loop: its trip count)


def partitioned_hlo(lowered) -> str:
  """HLO text of `lowered` (a `jax.stages.Lowered`) right after SPMD partitioning.

  Compiles it once with XLA's dump of that pass into a temporary folder (the compile
  is the ordinary one; its executable is discarded), with the persistent compilation
  cache off: a cache hit runs no pass and dumps nothing."""
  cache_on = jax.config.jax_enable_compilation_cache
  with tempfile.TemporaryDirectory(prefix="gem_jax_spmd_") as d:
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()   # the cache decides once per process whether it is used
    try:
      lowered.compile(compiler_options={"xla_dump_to": d,
                                        "xla_dump_hlo_pass_re": "spmd-partitioning"})
    finally:
      jax.config.update("jax_enable_compilation_cache", cache_on)
      compilation_cache.reset_cache()
    files = sorted(glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt")))
    if not files:
      raise RuntimeError("XLA wrote no program after spmd-partitioning (a single-device "
                         "program is not partitioned: use a mesh of 2 or more devices)")
    with open(files[-1], encoding="utf-8") as f:
      return f.read()


def _group_size(attrs: str) -> int:
  m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
  if m:   # mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=... {'axis_1'}
    sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if m:   # iota form [groups, size]<=[...]
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if m:   # explicit lists {{0,1,2,3},{4,5,6,7}}
    return len(m.group(1).split(","))
  return 0   # {} : every device


_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{\s*$")
_CALLS = re.compile(r"\b(?:to_apply|body|branch_computations|true_computation|false_computation)"
                    r"=\{?(%[^,}\s]+(?:, %[^,}\s]+)*)\}?")


def _trip_count(cond_lines: list[str]) -> int | None:
  """A scan's trip count from its loop condition `i < K` (counter from 0): K, else None."""
  root = [l for l in cond_lines if "ROOT" in l]
  consts = [int(c) for l in cond_lines for c in re.findall(r"s32\[\] constant\((\d+)\)", l)]
  if len(root) == 1 and "compare(" in root[0] and "direction=LT" in root[0] and len(consts) == 1:
    return consts[0]
  return None


def parse(text: str, num_devices: int = 0) -> list[Collective]:
  """The collectives of HLO `text` (one per instruction; a tuple's buffers summed per
  dtype), each with its executions per step: a loop body's run its trip count times
  (a scan's `i < K`; an unknown count counts once), a conditional's branches each once
  (an upper bound). `num_devices` sizes groups written as {} (all devices)."""
  comps: dict[str, list[str]] = {}
  entry, name = None, None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h:
      name = h.group(2)
      comps[name] = []
      entry = name if h.group(1) else entry
    elif name is not None:
      comps[name].append(line)
  calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}   # callee -> (caller, x)
  for caller, lines in comps.items():
    for line in lines:
      if " while(" in line:
        body = re.search(r"body=%([^,\s]+)", line).group(1)
        cond = re.search(r"condition=%([^,\s]+)", line).group(1)
        calls.setdefault(body, []).append((caller, _trip_count(comps.get(cond, [])) or 1))
        continue
      if not re.search(r" (call|conditional|async-start)\(", line):
        continue
      for m in _CALLS.finditer(line):
        for callee in re.findall(r"%([^,}\s]+)", m.group(1)):
          calls.setdefault(callee, []).append((caller, 1))

  memo: dict[str, int] = {}

  def runs(c: str) -> int:   # executions per step: 1 for the entry, summed over callers
    if c == entry:
      return 1
    if c not in memo:
      memo[c] = sum(runs(caller) * k for caller, k in calls.get(c, ()))
    return memo[c]

  out = []
  for comp, lines in comps.items():
    for line in lines:
      m = _LINE.match(line)
      if not m:
        continue
      typ, kind, _, rest = m.groups()
      group = _group_size(rest) or num_devices
      found = re.search(r'op_name="([^"]*)"', rest)
      op_name = found.group(1) if found else ""
      explicit = op_name.rsplit("/", 1)[-1] in EXPLICIT
      per_dtype: dict[str, int] = {}
      for dtype, dims in _ARRAY.findall(typ):
        n = math.prod(int(d) for d in dims.split(",") if d)
        per_dtype[dtype] = per_dtype.get(dtype, 0) + n * _BYTES.get(dtype, 4)
      for dtype, nbytes in per_dtype.items():
        if kind == "reduce-scatter":
          nbytes *= max(group, 1)
        out.append(Collective(kind, dtype, nbytes, group, explicit, op_name, runs(comp)))
  return out


def summary(collectives: list[Collective]) -> list[dict[str, Any]]:
  """Bytes per (source, kind, dtype, group size), largest first."""
  acc: dict[tuple, list[int]] = {}
  for c in collectives:
    key = ("code" if c.explicit else "partitioner", c.kind, c.dtype, c.group)
    acc.setdefault(key, [0, 0])
    acc[key][0] += c.nbytes * c.runs
    acc[key][1] += c.runs
  rows = [{"source": k[0], "kind": k[1], "dtype": k[2], "group": k[3], "count": v[1],
           "bytes": v[0]} for k, v in acc.items()]
  return sorted(rows, key=lambda r: -r["bytes"])


def dense_sync(collectives: list[Collective], dense_params: int, replicas: int, shards: int
               ) -> dict[str, float]:
  """Bytes per dense parameter and step of the partitioner's collectives (HSDP), in the
  units of `network.StepVolumes` (use a mesh with replicas != shards, e.g. (2, 4)).

  gather_bytes: all-gathers within the 'shard' group (every gather of a step: forward,
    and the backward's where remat recomputes it); the HSDP all-gather moves P x this.
  grad_bytes: reductions (all-reduce, reduce-scatter) within the 'shard' group (or the
    whole mesh): the gradients' reduce-scatter, P x this.
  replica_grad_bytes: reductions within the 'replica' group, x S: the cross-replica
    all-reduce of each shard's gradient moves P x this / S.
  other_bytes: every other partitioner collective (activation reshards), per parameter.
  """
  if replicas == shards:
    raise ValueError(f"mesh ({replicas}, {shards}): replica and shard groups must differ "
                     "in size to tell their collectives apart")
  acc = {"gather_bytes": 0, "grad_bytes": 0, "replica_grad_bytes": 0, "other_bytes": 0}
  for c in collectives:
    if c.explicit:
      continue
    nbytes = c.nbytes * c.runs
    reduces = c.kind in ("all-reduce", "reduce-scatter")
    if c.kind == "all-gather" and c.group == shards:
      acc["gather_bytes"] += nbytes
    elif reduces and c.group in (shards, replicas * shards):
      acc["grad_bytes"] += nbytes
    elif reduces and c.group == replicas:
      acc["replica_grad_bytes"] += nbytes * shards
    else:
      acc["other_bytes"] += nbytes
  return {k: v / max(dense_params, 1) for k, v in acc.items()}


def train_step_sync(config, replicas: int = 2, shards: int = 4) -> dict[str, float]:
  """`dense_sync` of `config`'s train step compiled for a (replicas, shards) mesh of the
  local devices, plus `dense_params`. The state stays abstract (nothing of the model's
  size is allocated: `gem_xl`'s 2.7 B parameters compile in ~40 s on a CPU); one batch of
  the config's source; bf16 matmuls as on a GPU (without XLA:CPU's row-major backward,
  `dense.row_major_backward`). `config` itself is left as it is."""
  config = copy.deepcopy(config)
  config.mesh = (replicas, shards)
  s = setup_lib.setup(config)
  batch = runner.device_batches(s, config, 1)[0]
  abstract_batch = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
  step = step_lib.jit_train_step(s.step_cfg, s.shardings,
                                 jax.tree.map(lambda x: x.sharding, batch))
  with dense.row_major_backward(False):
    text = partitioned_hlo(step.lower(s.abstract, abstract_batch))
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(s.abstract.params))
  out = dense_sync(parse(text, replicas * shards), params, replicas, shards)
  return {**out, "dense_params": float(params)}
