"""Readable tables of benchmark results and the gem_jax / TorchRec side-by-side summary."""
from __future__ import annotations

import math
from typing import Any, Sequence

from gem_jax.bench.timing import median_of


def _num(v: Any, fmt: str = "{:,.1f}") -> str:
  if v is None or (isinstance(v, float) and not math.isfinite(v)):
    return "-"
  return fmt.format(v)


def format_run(r: dict) -> str:
  """A two-column table of one gem_jax run."""
  gib = 2.0 ** 30
  rows = [
      ("config", f"{r.get('name')} ({r.get('model')}/{r.get('preset')}, {r.get('dtype')}"
                 f"{', fp8' if r.get('fp8') else ''})"),
      ("devices / mesh", f"{r.get('devices')} {r.get('backend')} ({r.get('device_kind')}) "
                         f"mesh {r.get('mesh')}"),
      ("batch", _num(r.get("batch_size"), "{:,d}")),
      ("input", f"{r.get('input', 'host')} " + (
          f"(generated on the devices, {_num(r['input_ms_median'], '{:.2f}')} ms alone)"
          if r.get("input_ms_median") is not None else f"(pool of {r.get('pool')})")),
      ("examples/s (median step)", _num(r.get("examples_per_s"))),
      ("examples/s (pipelined)", _num(r.get("examples_per_s_pipelined"))),
      ("step ms median/min/max", f"{_num(r.get('step_ms_median'), '{:.2f}')} / "
                                 f"{_num(r.get('step_ms_min'), '{:.2f}')} / "
                                 f"{_num(r.get('step_ms_max'), '{:.2f}')} "
                                 f"({r.get('steps')} steps)"),
      ("compile s cold / warm", f"{_num(r.get('compile_cold_s'), '{:.2f}')} / "
                                f"{_num(r.get('compile_warm_s'), '{:.2f}')}"),
      ("train GFLOP/example", _num((r.get("train_flops_per_example") or 0) / 1e9, "{:.4f}")),
      ("TFLOP/s per device", _num(r.get("tflops_per_device"), "{:.4f}")),
      ("peak TFLOP/s per device", f"{_num((r.get('peak_flops_per_device') or 0) / 1e12, '{:.3f}')}"
                                  f" ({r.get('peak_source')})"),
      *([("probe TFLOP/s start / end", f"{r['probe_flops_start'] / 1e12:.3f} / "
                                       f"{r['probe_flops_end'] / 1e12:.3f} (peak: the higher)")]
        if r.get("probe_flops_end") else []),
      ("MFU", _num(100 * (r.get("mfu") or float("nan")), "{:.1f} %")),
      ("dense part ms / MFU", f"{_num(r.get('dense_step_ms_median'), '{:.2f}')} / "
                              f"{_num(100 * (r.get('dense_mfu') or float('nan')), '{:.1f} %')}"),
      *([("dense MFU ceiling (matmuls alone)",
           f"{_num(100 * r['dense_mfu_ceiling'], '{:.1f} %')} ({r['matmul_count']} dots, "
           f"{_num(r['matmul_ms'], '{:.2f}')} ms, {_num(100 * r['matmul_efficiency'], '{:.1f}')}"
           f" % of peak)")] if "dense_mfu_ceiling" in r else []),
      ("embedding exchange B/step", _num(r.get("embedding_exchange_bytes_per_step"), "{:,d}")),
      ("memory GiB (compiled peak)", _num((r.get("mem_peak_bytes_compiled") or 0) / gib, "{:.3f}")),
      ("device peak GiB", _num(None if r.get("device_peak_bytes") is None
                               else r["device_peak_bytes"] / gib, "{:.3f}")),
      ("loss first / last", f"{_num(r.get('loss_first'), '{:.5f}')} / "
                            f"{_num(r.get('loss_last'), '{:.5f}')}"),
      ("load avg / other busy cores", f"{_num(r.get('loadavg_1m'), '{:.2f}')} / "
                                      f"{_num(r.get('other_busy_cores'), '{:.2f}')}"),
  ]
  w = max(len(k) for k, _ in rows)
  return "\n".join(f"  {k:<{w}} | {v}" for k, v in rows)


def format_matmuls(top: Sequence[dict]) -> str:
  """The dense part's dots by total time (the `matmul_top` rows of a run)."""
  lines = ["  dots by total time:  ms total  count  GFLOP/s  shape"]
  lines += [f"  {m['ms_total']:29.2f} {m['count']:6d} {m['gflops_per_s']:8.1f}  {m['shape']}"
            for m in top]
  return "\n".join(lines)


def format_matmul_side_by_side(m: dict) -> str:
  """Both sides' time for the same dots (`peer.matmul_side_by_side`), per step."""
  lines = [f"  dots alone, ms per step: gem_jax (XLA) {m['gem_jax_dot_ms']:.2f}, torch "
           f"{m['torch_dot_ms']:.2f}, ratio {m['ratio']:.2f} (> 1: torch's kernels faster)",
           "  gem_jax ms  torch ms  ratio  count  shape"]
  for r in m["rows"][:10]:
    t = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.2f}"
    q = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    lines.append(f"  {r['gem_jax_ms']:10.2f} {t:>9} {q:>6} {r['count']:6d}  {r['shape']}")
  return "\n".join(lines)


def format_peer(p: dict) -> str:
  return (f"  torchrec ({p.get('emb_impl')}, {p.get('interaction')}, {p.get('threads')} threads): "
          f"{_num(p.get('examples_per_s'))} examples/s, step {_num(p.get('step_ms_median'), '{:.2f}')}"
          f" ms median, loss {_num(p.get('loss_first'), '{:.5f}')} -> "
          f"{_num(p.get('loss_last'), '{:.5f}')}, load {_num(p.get('loadavg_1m'), '{:.2f}')}, "
          f"other busy cores {_num(p.get('other_busy_cores'), '{:.2f}')}")


def side_by_side(rows: Sequence[dict]) -> dict:
  """Medians over repeats of gem_jax and TorchRec examples/s, and their ratio.

  Also the ratio of each alternating pair (run r of both), whose median is less
  sensitive to load drifting over the whole session.
  """
  gem = [r for r in rows if r.get("framework") == "gem_jax"]
  peer = [r for r in rows if r.get("framework") == "torchrec"]
  g = median_of([r["examples_per_s"] for r in gem])
  t = median_of([r["examples_per_s"] for r in peer])
  pairs = []
  for a in gem:
    for b in peer:
      if a.get("repeat") == b.get("repeat") and b.get("examples_per_s"):
        pairs.append(a["examples_per_s"] / b["examples_per_s"])
  return {"summary": "side_by_side", "name": gem[0]["name"] if gem else None,
          "repeats": len(gem), "gem_jax_examples_per_s": g, "torchrec_examples_per_s": t,
          "ratio": g / t if t else float("nan"), "pair_ratios": pairs,
          "pair_ratio_median": median_of(pairs),
          "gem_jax_loadavg": [r.get("loadavg_1m") for r in gem],
          "torchrec_loadavg": [r.get("loadavg_1m") for r in peer],
          "gem_jax_other_busy_cores": [r.get("other_busy_cores") for r in gem],
          "torchrec_other_busy_cores": [r.get("other_busy_cores") for r in peer]}


def format_summary(s: dict) -> str:
  return (f"side by side ({s['name']}, {s['repeats']} runs each, medians): gem_jax "
          f"{_num(s['gem_jax_examples_per_s'])} ex/s, TorchRec {_num(s['torchrec_examples_per_s'])}"
          f" ex/s, ratio gem_jax/TorchRec = {_num(s['ratio'], '{:.2f}')} "
          f"(median of pair ratios {_num(s['pair_ratio_median'], '{:.2f}')})")
