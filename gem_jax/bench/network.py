"""A network model and the per-step communication of a sharding plan -> projected scaling.

Collective times (ring / pairwise algorithms, n devices, X = the full logical
buffer, bw = per-device bandwidth per direction, lat = per-hop latency):

  all_gather(X), reduce_scatter(X):  (n - 1) / n * X / bw + (n - 1) * lat
  all_reduce(X):                     2 (n - 1) / n * X / bw + 2 (n - 1) * lat
  all_to_all(X per device):          (n - 1) / n * X / bw + (n - 1) * lat

A group of n <= gpus_per_node devices uses the intra-node link (NVLink); a
larger group is limited by the inter-node link of each GPU (its own NIC, rails
aligned), so its bandwidth is the inter-node one (a stated simplification: no
hierarchical algorithms). Mesh (R, S): the 'shard' groups are S consecutive
devices (one node when S = gpus_per_node), 'replica' groups are strided, so
they cross nodes as soon as R > 1 and S = gpus_per_node.

Per step and device, for a GEM/DLRM with P dense parameters (fp32 master
weights, HSDP: FSDP over 'shard', replicated over 'replica'):

  embedding all-to-all (shard group)  the plan's forward exchange: ids out,
                                      embeddings back, their gradients out
  embedding replica sync              the plan's sync (per buffer, row gradients
                                      all-gathered over 'replica' or the shard's
                                      gradient reduce-scattered + all-gathered,
                                      whichever sends fewer bytes); `emb_sync='rows'`
                                      projects the row all-gather for every buffer
  HSDP all-gathers                    all_gather(P * gather_bytes) over 'shard';
                                      gather_bytes: measured from the compiled step
                                      (`gem_jax.bench.collectives.dense_sync`), else
                                      assumed 2 x param_bytes (two fp32 gathers:
                                      forward and backward)
  HSDP reduce-scatter                 reduce_scatter(P * grad_bytes) over 'shard'
  cross-replica sync                  all_reduce(P * replica_grad_bytes / S) over 'replica'
                                      (default grad_bytes; under grad_accum the shard
                                      reduction runs per micro-batch, this one once)

Step time without overlap: compute + all terms. With overlap: the embedding
forward all-to-all stays exposed (the dense part needs its result), everything
else hides behind compute: max(compute, other comm) + embedding all-to-all.
End-to-end MFU = train FLOPs/example x examples/s / (N x peak).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from gem_jax.bench.timing import median_of  # noqa: F401  (re-exported for scripts)


@dataclasses.dataclass(frozen=True)
class Network:
  """Link model of one cluster.

  Args:
    intra_bw: bytes/s per GPU per direction inside a node (NVLink H100/H200: 450e9).
    inter_bw: bytes/s per GPU per direction between nodes (400 Gb/s IB: 50e9).
    intra_lat, inter_lat: seconds per ring hop.
    gpus_per_node: devices per node.
  """
  intra_bw: float = 450e9
  inter_bw: float = 50e9
  intra_lat: float = 3e-6
  inter_lat: float = 10e-6
  gpus_per_node: int = 8

  def link(self, n: int, crosses_nodes: bool | None = None) -> tuple[float, float]:
    """(bandwidth, latency) of a group of n devices."""
    inter = n > self.gpus_per_node if crosses_nodes is None else crosses_nodes
    return (self.inter_bw, self.inter_lat) if inter else (self.intra_bw, self.intra_lat)

  def all_gather(self, nbytes: float, n: int, crosses_nodes: bool | None = None) -> float:
    if n <= 1:
      return 0.0
    bw, lat = self.link(n, crosses_nodes)
    return (n - 1) / n * nbytes / bw + (n - 1) * lat

  reduce_scatter = all_gather

  def all_reduce(self, nbytes: float, n: int, crosses_nodes: bool | None = None) -> float:
    return 2.0 * self.all_gather(nbytes, n, crosses_nodes)

  def all_to_all(self, nbytes_per_device: float, n: int,
                 crosses_nodes: bool | None = None) -> float:
    return self.all_gather(nbytes_per_device, n, crosses_nodes)

  def send(self, nbytes: float, n: int, crosses_nodes: bool | None = None, hops: int = 0) -> float:
    """`nbytes` already counted as what leaves the device, plus `hops` latencies
    (nothing to send: no collective, 0 s)."""
    if n <= 1 or nbytes <= 0:
      return 0.0
    bw, lat = self.link(n, crosses_nodes)
    return nbytes / bw + hops * lat


@dataclasses.dataclass(frozen=True)
class StepVolumes:
  """Bytes each device moves per step (already the part that leaves the device).

  Args:
    emb_a2a: embedding forward/backward exchange inside the shard group.
    emb_sync: embedding replica sync as the plan does it (`EmbeddingPlan.sync_bytes`).
    emb_sync_rows: the same sync with row gradients all-gathered for every buffer
      (the alternative, for comparison); None: not computed.
    emb_sync_mesh, emb_sync_mesh_rows: the same two for replicated tables, whose
      sync group is the whole mesh (R S devices) instead of 'replica'.
    dense_params: P.
    param_bytes, grad_bytes: bytes per parameter gathered (per gather) / reduced.
    gather_bytes: bytes per parameter all-gathered per step, every gather counted (a bf16
      model gathers each weight once in bf16: ~2; with remat also in the backward);
      None: the assumption 2 x param_bytes.
    replica_grad_bytes: bytes per parameter of the cross-replica all-reduce (of P / S per
      device); None: grad_bytes.
  """
  emb_a2a: float
  emb_sync: float
  emb_sync_rows: float | None
  dense_params: float
  param_bytes: int = 4
  grad_bytes: int = 4
  emb_sync_mesh: float = 0.0
  emb_sync_mesh_rows: float = 0.0
  gather_bytes: float | None = None
  replica_grad_bytes: float | None = None


def step_terms(vol: StepVolumes, net: Network, replicas: int, shards: int) -> dict[str, float]:
  """Seconds of each communication term of one step on an (R, S) mesh (see module doc)."""
  R, S = replicas, shards
  shard_cross = S > net.gpus_per_node
  rep_cross = R > 1 and R * S > net.gpus_per_node  # strided groups span the nodes
  mesh_cross = R * S > net.gpus_per_node
  p = vol.dense_params
  out = {
      "emb_a2a": net.send(vol.emb_a2a, S, shard_cross, hops=3 * (S - 1)),
      "hsdp_all_gather": (2 * net.all_gather(p * vol.param_bytes, S, shard_cross)
                          if vol.gather_bytes is None
                          else net.all_gather(p * vol.gather_bytes, S, shard_cross)),
      "hsdp_reduce_scatter": net.reduce_scatter(p * vol.grad_bytes, S, shard_cross),
      "replica_all_reduce": net.all_reduce(
          p * (vol.grad_bytes if vol.replica_grad_bytes is None else vol.replica_grad_bytes)
          / S, R, rep_cross),
      # two ring collectives either way: reduce-scatter + all-gather ('dense') or the
      # all-gathers of row ids and of gradients ('rows'): 2 (n - 1) hops.
      "emb_sync": (net.send(vol.emb_sync, R, rep_cross, hops=2 * (R - 1))
                   + net.send(vol.emb_sync_mesh, R * S, mesh_cross, hops=2 * (R * S - 1))),
  }
  if vol.emb_sync_rows is not None:
    out["emb_sync_rows"] = (net.send(vol.emb_sync_rows, R, rep_cross, hops=2 * (R - 1))
                            + net.send(vol.emb_sync_mesh_rows, R * S, mesh_cross,
                                       hops=2 * (R * S - 1)))
  return out


def project(compute_s: float, terms: dict[str, float], *, emb_sync: str = "plan"
            ) -> dict[str, float | str]:
  """Step time without and with overlap, and the term that limits the overlapped step.

  Args:
    compute_s: single-device step time at this per-device batch (no communication).
    terms: from `step_terms`.
    emb_sync: 'plan' (the sync the planner chose) or 'rows' (row all-gathers only).
  """
  sync = terms["emb_sync_rows"] if emb_sync == "rows" else terms["emb_sync"]
  hidden = {"hsdp_all_gather": terms["hsdp_all_gather"],
            "hsdp_reduce_scatter": terms["hsdp_reduce_scatter"],
            "replica_all_reduce": terms["replica_all_reduce"], "emb_sync": sync}
  comm_hidden = sum(hidden.values())
  no_overlap = compute_s + terms["emb_a2a"] + comm_hidden
  overlap = max(compute_s, comm_hidden) + terms["emb_a2a"]
  if comm_hidden > compute_s:
    limit = max(hidden, key=hidden.get)
  elif terms["emb_a2a"] > 0.1 * compute_s:
    limit = "emb_a2a"
  else:
    limit = "compute"
  return {"step_s_no_overlap": no_overlap, "step_s_overlap": overlap, "limit": limit,
          "comm_hidden_s": comm_hidden}


def mfu(flops_per_example: float, examples_per_s: float, n: int, peak: float) -> float:
  return flops_per_example * examples_per_s / (n * peak)


def mesh_for(n: int, shard: int) -> tuple[int, int]:
  """(R, S) for n devices with shard groups of `shard` (fewer if n < shard)."""
  s = min(shard, n)
  if n % s:
    raise ValueError(f"{n} devices are not divisible by shard groups of {s}")
  return n // s, s


def device_counts(lo: int = 8, hi: int = 4096) -> list[int]:
  out, n = [], lo
  while n <= hi:
    out.append(n)
    n *= 2
  return out


def cpu_network(bw: float = 5e9, lat: float = 20e-6) -> Network:
  """The 'network' of simulated CPU devices in one process: memcpy bandwidth, no nodes."""
  return Network(intra_bw=bw, inter_bw=bw, intra_lat=lat, inter_lat=lat, gpus_per_node=1 << 30)


def table_rows(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A plain fixed-width table."""
  cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
  w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  lines = [" | ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in cells]
  lines.insert(1, "-+-".join("-" * x for x in w))
  return "\n".join(lines)


def _cell(c) -> str:
  if isinstance(c, float):
    if not math.isfinite(c):
      return "-"
    return f"{c:.4g}"
  return str(c)
