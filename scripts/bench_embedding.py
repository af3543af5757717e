"""Embedding lookup + sparse update step time against table size.

  python scripts/bench_embedding.py --rows 100000 1000000 10000000 --json

Each size: 8 tables sharing `rows` rows, dim 64, global batch 4096, 4 ids per
bag (sum pooling), Zipf(1.1) raw ids hashed into range, row-wise Adagrad, on an
8-device CPU mesh (forced host devices). One step = gather_rows + pool_rows +
backward to the rows + apply_sparse_updates, jitted once with the state donated.
Sizes are timed in interleaved rounds. Prints one line per size (JSON with --json).

  python scripts/bench_embedding.py --rows 1000000 --group 2 4 8 --batch 512 --bag 1 \
      --sharding row_wise --rw-exchange a2a broadcast

times the row-wise exchange against the group size S (mesh 1 x S, 512 examples per
device): per-device work (step time x cores / S) and bytes, by owner and by broadcast.
'ragged' runs `ragged_all_to_all`'s contract on padded blocks here (XLA:CPU has no
ragged-all-to-all): its bytes are what a GPU sends, its CPU time is not.

  python scripts/bench_embedding.py --batch 512 --bag 1 --project-group 8 32 128 256

plans (nothing runs) groups of S devices and prints, per device, the ids on the wire and
the exchange buffers of the padded all_to_all (C per pair) against the ragged exchange
(M per owner), the cost of growing the group 32x.

  python scripts/bench_embedding.py --rows 2000000 --tables 2 --mesh 1 1 \
      --sharding table_wise --freeze 1 --freeze-by drop select

freezes the first table (knowledge transfer's `freeze_shared`) and times the two
ways side by side: `drop` (the trainer's: `apply_sparse_updates(..., frozen=)`
drops the frozen rows' updates) and `select` (update everything, then select the
frozen rows back over the whole buffer: `transfer.student.keep_frozen_rows`).

  python scripts/bench_embedding.py --rows 100000 10000000 --sharding row_wise \
      --id-policy hash managed

times managed-collision tables (a map per table, gem_jax/embedding/managed.py: the step
resolves raw ids through it first) against hashed ones at the same table rows (rounded to
whole probe windows), side by side, and reports the map's bytes (stated per row and
measured on the state). The id stream decides what the managed step does: `--id-stream
cycle` (the default) repeats 4 batches, so a table that holds their ids serves hits after
the first steps, and one that does not (10^5 rows here) re-inserts most of them every
step; `fresh` draws a new batch every step (new raw ids keep arriving: inserts at every
size); `--id-population P` draws each table's raw ids from P values (a population that
fits the table: hits). Each run prints the managed counters of its last step (share of
the batch's distinct ids that were hits, inserts, evictions), so sizes are compared in
the same regime.

Host memory: the script re-executes itself under the trainer's host malloc
(`hostmem.use_host_malloc`): jemalloc where installed, its freed pages kept for the next
step (no page faults on the step's temporaries), else glibc's with transparent huge
pages for large blocks. `--no-hugepages` keeps glibc's 4 KiB pages (to compare).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gem_jax import hostmem  # noqa: E402  (no jax import: before the re-exec)

if __name__ == "__main__":
  hostmem.use_host_malloc("--no-hugepages" not in sys.argv)

def _devices_needed(argv) -> int:
  """8, or the largest --project-group size (planning a group needs its devices)."""
  if "--project-group" not in argv:
    return 8
  sizes = [a for a in argv[argv.index("--project-group") + 1:] if a.isdigit()]
  return max([8] + [int(a) for a in sizes])


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={_devices_needed(sys.argv)}").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gem_jax.embedding import (FeatureConfig, SparseOptimizerConfig, TableConfig,  # noqa: E402
                               apply_sparse_updates, gather_rows, init_embedding_state,
                               hash_ids, id_stats, managed, plan_embeddings, pool_rows,
                               prepare_ids)
from gem_jax.embedding.plan import DEDUP_MIN_BYTES, MAP_BYTES_PER_ROW, MAP_LEAVES  # noqa: E402
from gem_jax.parallel.mesh import make_mesh  # noqa: E402
from gem_jax.transfer.student import frozen_row_ranges, keep_frozen_rows  # noqa: E402


def make_step(plan, frozen=None, freeze_by="drop"):
  def loss_fn(rows, ctx):
    emb = pool_rows(plan, rows, ctx)
    return sum(jnp.sum(e * e) for e in emb.values()) / plan.batch_size

  def step(state, ids, t):
    known, counters = {}, {}
    if plan.managed_tables():   # raw ids -> rows through the maps (managed.py), step t
      state, ids, counters, known = managed.resolve(plan, state, ids, t, jax.random.key(1),
                                                    distinct=True)
    rows, ctx = gather_rows(plan, state, ids, known)
    loss, g = jax.value_and_grad(loss_fn)(rows, ctx)
    if frozen and freeze_by == "select":
      return keep_frozen_rows(apply_sparse_updates(plan, state, ctx, g), state, frozen), (
          loss, counters)
    return apply_sparse_updates(plan, state, ctx, g, frozen=frozen), (loss, counters)
  return jax.jit(step, donate_argnums=0)


def setup(rows: int, args, freeze_by: str = "drop", mesh_shape=None, batch=None,
          rw_exchange: str = "a2a", id_policy: str = "hash") -> dict:
  """Plan, state, id batches and the compiled step of one size (and mesh, batch, exchange,
  id policy: raw Zipf ids are unbounded, hashed or managed)."""
  batch = batch or args.batch
  n_tables = args.tables
  per = rows // n_tables
  if len(args.id_policy) > 1 or id_policy == "managed":   # the same rows under both policies
    per = -(-per // args.probe) * args.probe
  tables = [TableConfig(f"t{i}", per, args.dim, sharding=args.sharding, id_policy=id_policy,
                        probe=args.probe, eviction=args.eviction)
            for i in range(n_tables)]
  feats = [FeatureConfig(f"f{i}", f"t{i}", args.bag) for i in range(n_tables)]
  mesh = make_mesh(tuple(mesh_shape or args.mesh))
  rng = np.random.default_rng(0)
  raws = []
  n_batches = 4 if args.id_stream == "cycle" else 1 + args.warmup + args.steps
  for _ in range(n_batches):
    raw = {f.name: rng.zipf(1.1, (batch, args.bag)).astype(np.int64) for f in feats}
    if args.id_population:   # ranks folded onto P values per table (the head stays the head)
      raw = {f: (x - 1) % args.id_population + 1 for f, x in raw.items()}
    if id_policy == "managed":   # ids spread over 63 bits, as raw ids are
      raw = {f: hash_ids(x, 1 << 62) for f, x in raw.items()}
    raws.append(raw)
  stats = (id_stats(tables, feats, raws[:4], num_devices=mesh.devices.size,
                    num_shards=mesh.shape["shard"]) if args.id_stats else None)
  dedup_min = {"auto": DEDUP_MIN_BYTES, "always": 0, "never": 1 << 62}[args.dedup]
  plan = plan_embeddings(tables, feats, mesh, batch, SparseOptimizerConfig(lr=0.01),
                         dedup_min_bytes=dedup_min, rw_exchange=rw_exchange, id_stats=stats)
  t0 = time.perf_counter()
  state = jax.block_until_ready(init_embedding_state(plan, jax.random.key(0)))
  init_s = time.perf_counter() - t0
  batches = [jax.device_put(prepare_ids(plan, raw), plan.ids_shardings()) for raw in raws]
  frozen = frozen_row_ranges(plan, [t.name for t in tables[:args.freeze]])
  step = make_step(plan, frozen, freeze_by)
  t0 = time.perf_counter()
  state, (loss, counters) = step(state, batches[0], jnp.int32(0))
  jax.block_until_ready(loss)
  compile_s = time.perf_counter() - t0
  for i in range(args.warmup):
    state, (loss, counters) = step(state, batches[(i + 1) % len(batches)], jnp.int32(i + 1))
  jax.block_until_ready(state)
  return {"rows": rows, "freeze_by": freeze_by, "plan": plan, "state": state,
          "id_policy": id_policy, "t": args.warmup + 1, "counters": counters,
          "fresh": args.id_stream == "fresh",
          "rw_exchange": rw_exchange, "batch": batch,
          "batches": batches, "step": step,
          "loss": loss, "times": [], "init_s": init_s, "compile_s": compile_s,
          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def timed_step(run: dict, i: int) -> None:
  """Step i of the timed ones: the cycle's batch i mod 4, or the stream's next batch."""
  batches = run["batches"]
  b = batches[min(run["t"], len(batches) - 1)] if run["fresh"] else batches[i % 4]
  t0 = time.perf_counter()
  run["state"], (run["loss"], run["counters"]) = run["step"](run["state"], b, jnp.int32(run["t"]))
  run["t"] += 1
  jax.block_until_ready((run["state"], run["loss"]))
  run["times"].append((time.perf_counter() - t0) * 1e3)


def _map_bytes(state) -> int:
  """Bytes of the managed maps in the (global) state: every map leaf, as allocated."""
  return int(sum(x.nbytes for buf in state.values() for k, x in buf.items()
                 if k in MAP_LEAVES))


def _regime(counters: dict) -> dict:
  """The managed tables' last step, summed over tables: distinct ids and the shares of them
  that were hits, inserts and evictions (empty for hashed tables)."""
  if not counters:
    return {}
  tot = {k: sum(int(c[k]) for c in counters.values())
         for k in ("ids", "hits", "inserts", "evictions", "collisions")}
  ids = max(tot["ids"], 1)
  return {"mc_ids_per_table": tot["ids"] / len(counters),
          **{f"mc_{k}_share": tot[k] / ids for k in ("hits", "inserts", "evictions",
                                                   "collisions")}}


def summary(run: dict, args) -> dict:
  plan, times = run["plan"], run["times"]
  return {
      "id_stream": args.id_stream, "id_population": args.id_population,
      **_regime(run["counters"]),
      "rows": run["rows"], "tables": args.tables, "dim": args.dim, "batch": run["batch"],
      "rw_exchange": run["rw_exchange"], "id_policy": run["id_policy"],
      "table_rows": int(plan.tables["t0"].rows),
      "map_bytes_per_row": MAP_BYTES_PER_ROW if run["id_policy"] == "managed" else 0,
      "map_bytes_measured": _map_bytes(run["state"]),
      "id_stats": bool(plan.id_stats),
      "managed_route_slots": (  # ids each owner resolves per table: S C padded, M ragged,
          (plan.managed_owner_distinct("t0") if plan.num_shards == 1 else   # one shard: its cap
           (plan.managed_capacity("t0")[1] if plan.rw_exchange == "ragged" else
            plan.num_shards * plan.managed_capacity("t0")[0]) * plan.num_replicas)
          if run["id_policy"] == "managed" else None),
      "frozen_tables": args.freeze, "freeze_by": run["freeze_by"] if args.freeze else None,
      "bag": args.bag, "mesh": list(plan.mesh.devices.shape),
      "sharding": sorted(set(plan.sharding.values())),
      "dedup": sorted({u.dedup for u in plan.units.values()}),
      "step_ms_median": float(np.median(times)), "step_ms_min": float(np.min(times)),
      "step_ms_max": float(np.max(times)), "steps": len(times),
      "exchange_bytes_per_step": int(sum(plan.exchange_bytes().values())),
      "table_bytes": int(run["rows"] * args.dim * 4),
      "peak_rss_mb": run["peak_rss_mb"], "init_s": run["init_s"],
      "compile_s": run["compile_s"], "loss": float(run["loss"]),
      "hugepages": hostmem.huge_pages_requested(),
      "anon_hugepages_mb": hostmem.anon_huge_pages_mb(),
      "loadavg_1m": os.getloadavg()[0],
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000],
                 help="total rows over all tables, one table set per value (give them "
                      "ascending: peak RSS is the process maximum after that set is built)")
  p.add_argument("--tables", type=int, default=8)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--batch", type=int, default=4096)
  p.add_argument("--bag", type=int, default=4)
  p.add_argument("--mesh", type=int, nargs=2, default=[1, 8], metavar=("REPLICA", "SHARD"))
  p.add_argument("--sharding", default="auto",
                 choices=["auto", "table_wise", "row_wise", "column_wise", "replicated"])
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--json", action="store_true", help="one JSON object per line")
  p.add_argument("--dedup", default="auto", choices=["auto", "always", "never"],
                 help="owners deduplicate ids before gathering by the planner's size rule "
                      "(auto, the trainer's default: blocks of >= 4 GiB per device, so no "
                      "size here), at every size (always), or never")
  p.add_argument("--freeze", type=int, default=0, metavar="K",
                 help="freeze the first K tables (their rows and slots stay bit-identical)")
  p.add_argument("--freeze-by", nargs="+", default=["drop"], choices=["drop", "select"],
                 help="how frozen rows are kept (see module doc); several: side by side")
  p.add_argument("--no-hugepages", action="store_true",
                 help="do not ask glibc for transparent huge pages (see module doc)")
  p.add_argument("--group", type=int, nargs="+", default=None, metavar="S",
                 help="group-size series instead of sizes: mesh 1 x S for each S, the first "
                      "--rows value, --batch examples per device (global batch S x batch), "
                      "each --rw-exchange side by side; prints per-device work and bytes")
  p.add_argument("--id-policy", nargs="+", default=["hash"], choices=["hash", "managed"],
                 help="raw ids hashed into range or managed (a map per table, managed.py); "
                      "several: side by side at the same table rows (rounded to --probe)")
  p.add_argument("--probe", type=int, default=8, help="managed: rows per probe window")
  p.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
  p.add_argument("--rw-exchange", nargs="+", default=["a2a"],
                 choices=["a2a", "ragged", "broadcast"],
                 help="row-wise lookups by owner (padded all_to_all or ragged_all_to_all, "
                      "the latter emulated on CPU) or by broadcast (all_gather)")
  p.add_argument("--project-group", type=int, nargs="+", default=None, metavar="S",
                 help="plan (run nothing) 1 x S groups: per-device wire ids and buffers, "
                      "padded against ragged (--batch examples per device)")
  p.add_argument("--id-stream", default="cycle", choices=["cycle", "fresh"],
                 help="cycle: 4 batches repeated; fresh: a new batch every step")
  p.add_argument("--id-population", type=int, default=0, metavar="P",
                 help="raw ids per table drawn from P values (0: unbounded Zipf ranks)")
  p.add_argument("--id-stats", action="store_true",
                 help="plan with the id statistics of the timed batches (row-wise capacities "
                      "from their distinct ids, as the trainer's embedding.id_stats_batches)")
  p.add_argument("--distinct", type=float, default=1.0,
                 help="--project-group: distinct ids / id slots per device (1: the "
                      "planner's default without id statistics)")
  args = p.parse_args(argv)
  if args.project_group:
    return project_group(args)
  if args.group:
    return group_series(args)
  # All sizes are set up first (ascending, so peak RSS is that of sizes so far),
  # then timed in interleaved rounds, so that load from other processes drifts
  # over all sizes alike and their ratio stays meaningful.
  if len(args.id_policy) > 1 or args.id_policy != ["hash"]:
    return policy_series(args)
  modes = args.freeze_by if args.freeze else ["drop"]
  runs = [setup(rows, args, mode) for rows in args.rows for mode in modes]
  for i in range(args.steps):
    for run in runs:
      timed_step(run, i)
  results = []
  for run in runs:
    r = summary(run, args)
    results.append(r)
    rows = r["rows"]
    if args.json:
      print(json.dumps(r), flush=True)
    else:
      how = f" [freeze {args.freeze} by {r['freeze_by']}]" if args.freeze else ""
      print(f"rows {rows:>11,d}{how}: step median {r['step_ms_median']:.1f} ms (min "
            f"{r['step_ms_min']:.1f}, max {r['step_ms_max']:.1f}), exchange "
            f"{r['exchange_bytes_per_step']:,d} B/step, peak RSS {r['peak_rss_mb']:.0f} MB",
            flush=True)
  if len(modes) > 1 and not args.json:
    for a, b in zip(results[::len(modes)], results[1::len(modes)]):
      print(f"rows {a['rows']:,d}: {b['freeze_by']} / {a['freeze_by']} median "
            f"{b['step_ms_median'] / a['step_ms_median']:.2f}")
  elif len(results) > 1 and not args.json:
    print(f"ratio largest/smallest median: "
          f"{results[-1]['step_ms_median'] / results[0]['step_ms_median']:.2f}")
  return results


def policy_series(args) -> list[dict]:
  """Each size under each id policy, timed in interleaved rounds: managed / hash per size."""
  runs = [setup(rows, args, id_policy=pol, rw_exchange=args.rw_exchange[0])
          for rows in args.rows for pol in args.id_policy]
  for i in range(args.steps):
    for run in runs:
      timed_step(run, i)
  results = [summary(run, args) for run in runs]
  for r in results:
    if args.json:
      print(json.dumps(r), flush=True)
    else:
      regime = (f", last step: {r['mc_ids_per_table']:,.0f} distinct ids per table, hits "
                f"{r['mc_hits_share']:.0%}, inserts {r['mc_inserts_share']:.0%} (evicting "
                f"{r['mc_evictions_share']:.0%}), no row {r['mc_collisions_share']:.0%}"
                if "mc_ids_per_table" in r else "")
      print(f"rows {r['rows']:>11,d} {r['id_policy']:>8}: step median {r['step_ms_median']:.1f} "
            f"ms (min {r['step_ms_min']:.1f}), map {r['map_bytes_measured']:,d} B "
            f"({r['map_bytes_measured'] / (r['table_rows'] * args.tables):.1f} B/row), "
            f"peak RSS {r['peak_rss_mb']:.0f} MB{regime}", flush=True)
  if not args.json and len(args.id_policy) > 1:
    for rows in args.rows:
      by = {r["id_policy"]: r["step_ms_median"] for r in results if r["rows"] == rows}
      a, b = args.id_policy[0], args.id_policy[-1]
      print(f"rows {rows:,d}: {b} / {a} median {by[b] / by[a]:.2f}")
  return results


def group_series(args) -> list[dict]:
  """Per-device cost against the group size S at a fixed per-device batch.

  The S simulated devices share this machine's cores, so per-device work is
  step time x cores / S; bytes are the plan's per-device exchange bytes.
  """
  cores = os.cpu_count() or 1
  runs = [setup(args.rows[0], args, "drop", (1, S), args.batch * S, ex)
          for S in args.group for ex in args.rw_exchange]
  for i in range(args.steps):
    for run in runs:
      timed_step(run, i)
  results = []
  for run in runs:
    r = summary(run, args)
    S = r["mesh"][1]
    r.update(group=S, per_device_batch=args.batch, cores=cores,
             work_ms_per_device=r["step_ms_median"] * cores / S,
             exchange_bytes_per_device=r["exchange_bytes_per_step"],
             buffer_bytes_per_device=sum(run["plan"].rw_buffer_bytes().values()))
    results.append(r)
    if args.json:
      print(json.dumps(r), flush=True)
  if not args.json:
    print(f"rows {args.rows[0]:,d}, {args.tables} row-wise tables x dim {args.dim}, "
          f"{args.batch} examples x bag {args.bag} per device, Zipf(1.1), {cores} cores")
    print(f"{'S':>3} {'exchange':>9} {'step ms':>8} {'work ms/dev':>11} "
          f"{'bytes out/dev':>13} {'buffers/dev':>12}")
    for r in results:
      print(f"{r['group']:>3} {r['rw_exchange']:>9} {r['step_ms_median']:>8.1f} "
            f"{r['work_ms_per_device']:>11.1f} {r['exchange_bytes_per_device']:>13,d} "
            f"{r['buffer_bytes_per_device']:>12,d}")
    for ex in args.rw_exchange:
      mine = [r for r in results if r["rw_exchange"] == ex]
      lo, hi = mine[0], mine[-1]
      print(f"{ex}: S={hi['group']} / S={lo['group']}: work "
            f"{hi['work_ms_per_device'] / lo['work_ms_per_device']:.2f}x, bytes out "
            f"{hi['exchange_bytes_per_device'] / lo['exchange_bytes_per_device']:.2f}x, "
            f"buffers {hi['buffer_bytes_per_device'] / lo['buffer_bytes_per_device']:.2f}x")
  return results


def project_group(args) -> list[dict]:
  """Row-wise exchange cost per device against S, from the planner alone (no state)."""
  table = TableConfig("t", args.rows[0], args.dim, sharding="row_wise")
  feat = FeatureConfig("f", "t", args.bag)
  results = []
  for S in args.project_group:
    row = {"group": S, "per_device_batch": args.batch, "bag": args.bag, "dim": args.dim}
    for ex in ("a2a", "ragged"):
      plan = plan_embeddings([table], [feat], make_mesh((1, S)), args.batch * S,
                             rw_exchange=ex, distinct_share={"f": args.distinct})
      u = plan.units["row_wise.f"]
      row[ex] = {"capacity": plan.capacity(u) if ex == "a2a" else plan.recv_capacity(u),
                 "wire_ids": plan.rw_wire_ids(u), "buffer_slots": plan.rw_slots(u),
                 "bytes_out": int(plan.forward_bytes()["row_wise.f"]),
                 "buffer_bytes": int(plan.rw_buffer_bytes()["row_wise.f"])}
    results.append(row)
    if args.json:
      print(json.dumps(row), flush=True)
  if not args.json:
    n = args.distinct * args.batch * args.bag
    print(f"row-wise, {args.batch} examples x bag {args.bag} per device ({n:.0f} distinct "
          f"ids), dim {args.dim} fp32: per device and step, planned (nothing runs)")
    print(f"{'S':>4} {'C/pair':>6} {'M/owner':>7} {'wire ids a2a':>12} {'ragged':>7} "
          f"{'bytes out a2a':>13} {'ragged':>10} {'buffers a2a':>11} {'ragged':>10}")
    for r in results:
      a, g = r["a2a"], r["ragged"]
      print(f"{r['group']:>4} {a['capacity']:>6} {g['capacity']:>7} {a['wire_ids']:>12,d} "
            f"{g['wire_ids']:>7,.0f} {a['bytes_out']:>13,d} {g['bytes_out']:>10,d} "
            f"{a['buffer_bytes']:>11,d} {g['buffer_bytes']:>10,d}")
    lo, hi = results[0], results[-1]
    for ex in ("a2a", "ragged"):
      print(f"{ex}: S={hi['group']} / S={lo['group']}: bytes out "
            f"{hi[ex]['bytes_out'] / lo[ex]['bytes_out']:.2f}x, buffers "
            f"{hi[ex]['buffer_bytes'] / lo[ex]['buffer_bytes']:.2f}x")
  return results


if __name__ == "__main__":
  main()
