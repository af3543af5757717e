"""`scripts/project_scale.py`: the projection table and the CPU-mesh check (see network.py)."""
from __future__ import annotations

import ast
import json
import sys
from typing import Any

from gem_jax.bench import collectives
from gem_jax.bench import network
from gem_jax.bench import runner
from gem_jax.bench import scale


def _overrides(items) -> dict[str, Any]:
  out = {}
  for item in items:
    k, _, v = item.partition("=")
    try:
      out[k.strip()] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
      out[k.strip()] = v
  return out


def compute_time(args, config, facts: scale.ModelFacts, b: int) -> tuple[float, str, float]:
  """(seconds per step at per-device batch b, where it comes from, peak FLOP/s)."""
  if args.from_json:
    rows = [json.loads(l) for l in open(args.from_json, encoding="utf-8") if l.strip()]
    rows = [r for r in rows if r.get("framework") == "gem_jax"]
    r = rows[-1]
    t = r["step_ms_median"] / 1e3 * b / r["batch_size"]
    return t, f"measured ({args.from_json}: {r['device_kind']}, batch {r['batch_size']})", \
        r["peak_flops_per_device"]
  if args.measure:
    c = runner.fit_mesh(runner.load_config(args.config, {**_overrides(args.set),
                                                         "data.batch_size": b}), 1)
    c.mesh = (1, 1)
    r = runner.run_benchmark(c, runner.BenchOptions(steps=20, warmup=3, dense_part=False,
                                                    warm_compile=False), name=args.config)
    return r["step_ms_median"] / 1e3, f"measured here ({r['device_kind']})", \
        r["peak_flops_per_device"]
  t = facts.train_flops_per_example * b / (args.device_mfu * args.peak)
  return t, f"assumed: {100 * args.device_mfu:.0f} % single-device MFU", args.peak


def hsdp_bytes(args, config) -> tuple[dict, str]:
  """`scale.plan_volumes`' bytes per dense parameter of the HSDP terms, and their source."""
  if not args.comm_from_hlo:
    return ({"param_bytes": args.param_bytes},
            f"assumed: 2 gathers x {args.param_bytes} B, fp32 gradients")
  sync = collectives.train_step_sync(config)
  return ({"param_bytes": args.param_bytes, "grad_bytes": sync["grad_bytes"],
           "gather_bytes": sync["gather_bytes"],
           "replica_grad_bytes": sync["replica_grad_bytes"]},
          f"from the compiled step (2x4 CPU mesh): gathers {sync['gather_bytes']:.2f} B, "
          f"gradients {sync['grad_bytes']:.2f} B (replica {sync['replica_grad_bytes']:.2f} B), "
          f"other {sync['other_bytes']:.3f} B per param and step")


def projection_rows(args, config, facts, b: int, t_compute: float, peak: float,
                    net: network.Network, hsdp: dict) -> list[dict]:
  rows = []
  for n in network.device_counts(args.min_devices, args.max_devices):
    R, S = network.mesh_for(n, args.shard)
    vol = scale.plan_volumes(facts, config, R, S, b, **hsdp)
    terms = network.step_terms(vol, net, R, S)
    row = {"devices": n, "mesh": [R, S], "per_device_batch": b, "compute_s": t_compute,
           **{f"{k}_s": v for k, v in terms.items()}}
    for sync in ("plan", "rows"):
      p = network.project(t_compute, terms, emb_sync=sync)
      for k in ("no_overlap", "overlap"):
        st = p[f"step_s_{k}"]
        eps = b * n / st
        row[f"{sync}_{k}_step_s"] = st
        row[f"{sync}_{k}_examples_per_s"] = eps
        row[f"{sync}_{k}_mfu"] = network.mfu(facts.train_flops_per_example, eps, n, peak)
      row[f"{sync}_limit"] = p["limit"]
    rows.append(row)
  return rows


def print_rows(rows: list[dict], file=sys.stderr) -> None:
  headers = ["GPUs", "mesh", "compute ms", "emb a2a ms", "HSDP ms", "repl AR ms",
             "emb sync ms (plan/rows)", "ex/s overlap", "MFU no-ovl", "MFU ovl",
             "MFU ovl, rows sync", "limit (plan / rows sync)"]
  table = []
  for r in rows:
    hsdp = 1e3 * (r["hsdp_all_gather_s"] + r["hsdp_reduce_scatter_s"])
    table.append([r["devices"], f"{r['mesh'][0]}x{r['mesh'][1]}", 1e3 * r["compute_s"],
                  1e3 * r["emb_a2a_s"], hsdp, 1e3 * r["replica_all_reduce_s"],
                  f"{1e3 * r['emb_sync_s']:.4g} / {1e3 * r.get('emb_sync_rows_s', 0):.4g}",
                  r["plan_overlap_examples_per_s"], f"{100 * r['plan_no_overlap_mfu']:.1f} %",
                  f"{100 * r['plan_overlap_mfu']:.1f} %",
                  f"{100 * r['rows_overlap_mfu']:.1f} %",
                  f"{r['plan_limit']} / {r['rows_limit']}"])
  print(network.table_rows(headers, table), file=file)


def cpu_check(args, config, facts) -> list[dict]:
  """Measured vs projected step time on 1x8 and 2x4 meshes of 8 simulated CPU devices.

  Projection for the CPU: the 8 devices share the host's cores, so compute is
  8 x the 1-device step at the per-device batch; collectives are memcpys
  (`network.cpu_network`), not overlapped.
  """
  import jax  # pylint: disable=import-outside-toplevel
  if jax.device_count() < 8:
    raise SystemExit("--check-cpu needs 8 devices (XLA_FLAGS is set by the script)")
  B = config.data.batch_size
  b = B // 8
  opts = runner.BenchOptions(steps=args.check_steps, warmup=3, dense_part=False,
                             warm_compile=False)
  one = runner.load_config(args.config, {**_overrides(args.set), "data.batch_size": b})
  one.mesh = (1, 1)
  t1 = runner.run_benchmark(one, opts, name=args.config)["step_ms_median"] / 1e3
  net = network.cpu_network(args.cpu_bw, args.cpu_lat)
  out = []
  for R, S in ((1, 8), (2, 4)):
    c = runner.load_config(args.config, _overrides(args.set))
    c.mesh = (R, S)
    meas = runner.run_benchmark(c, opts, name=args.config)
    vol = scale.plan_volumes(facts, c, R, S, b, param_bytes=4)
    terms = network.step_terms(vol, net, R, S)
    proj = network.project(8 * t1, terms)["step_s_no_overlap"]
    out.append({"check": "cpu", "mesh": [R, S], "global_batch": B, "one_device_step_s": t1,
                "measured_step_s": meas["step_ms_median"] / 1e3, "projected_step_s": proj,
                "measured_over_projected": meas["step_ms_median"] / 1e3 / proj,
                "comm_s": {k: v for k, v in terms.items()},
                "loadavg_1m": meas["loadavg_1m"]})
  return out


def run(args) -> dict:
  config = runner.load_config(args.config, _overrides(args.set))
  facts = scale.model_facts(config)
  b = args.per_device_batch or max(config.data.batch_size // 8, 1)
  net = network.Network(args.intra_bw, args.inter_bw, args.intra_lat, args.inter_lat,
                        args.gpus_per_node)
  t, source, peak = compute_time(args, config, facts, b)
  hsdp, hsdp_source = hsdp_bytes(args, config)
  rows = projection_rows(args, config, facts, b, t, peak, net, hsdp)
  print(f"{args.config}: {facts.train_flops_per_example / 1e9:.3f} train GFLOP/example, "
        f"{facts.dense_params / 1e6:.1f} M dense params, per-device batch {b}, "
        f"compute {1e3 * t:.2f} ms/step ({source}), peak {peak / 1e12:.0f} TFLOP/s; "
        f"tables: {scale.describe_sharding(facts, config, args.shard, b)}", file=sys.stderr)
  print(f"network: {net}", file=sys.stderr)
  print(f"HSDP: {hsdp_source}", file=sys.stderr)
  print_rows(rows)
  out = {"rows": rows, "compute_source": source, "hsdp_source": hsdp_source, "hsdp_bytes": hsdp}
  if args.check_cpu:
    out["check"] = cpu_check(args, config, facts)
    print(network.table_rows(
        ["CPU mesh", "measured ms", "projected ms", "measured/projected", "load"],
        [[f"{c['mesh'][0]}x{c['mesh'][1]}", 1e3 * c["measured_step_s"],
          1e3 * c["projected_step_s"], c["measured_over_projected"], c["loadavg_1m"]]
         for c in out["check"]]), file=sys.stderr)
  return out
