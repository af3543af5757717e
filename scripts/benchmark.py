"""Benchmarks a config's train step; optionally runs the TorchRec peer side by side.

  python scripts/benchmark.py --config small
  python scripts/benchmark.py --config dlrm_peer --devices 1 --peer torchrec --repeat 3
  python scripts/benchmark.py --config dcn_peer --devices 1 --peer torchrec --json
  python scripts/benchmark.py --config medium --set model.fp8=True --json
  python scripts/benchmark.py --config small --devices 1 --matmul-ceiling
  python scripts/benchmark.py --config dcn_peer --devices 1 --matmul-ceiling --peer torchrec
  python scripts/benchmark.py --config medium --devices 1 --input device --json

Prints a readable table (stderr) and, with --json, one JSON line per run on
stdout (also appended to --out). With --peer torchrec, gem_jax and the peer
(benchmarks/torchrec/bench.py in the venv of `bash benchmarks/torchrec/setup.sh`)
alternate (never concurrently) --repeat times, on the same arrays and in the same
precision (gem_jax bf16 compute -> the peer's `--autocast bf16`, fp32 -> off;
--peer-autocast to choose); the summary line holds the medians and the ratio
gem_jax / TorchRec of examples/s, the precision of each side, and the load average
of every run. --matmul-ceiling with --peer also times the dense part's dots in torch
(benchmarks/torchrec/matmul.py, same shapes, dtype and threads): which side's
matmul kernels are faster, apart from everything else in the step. Fields: see gem_jax/bench/runner.py. Host memory uses transparent
huge pages for both sides unless --no-hugepages (gem_jax/hostmem.py).

Input (--input, JSON field `input`): `host` (default) cycles a pool of --pool
batches of the config's source, put on the devices before timing, so neither
Python nor the transfer is timed; it is the default because the TorchRec peer
reads the same pool (same arrays) and earlier results were measured this way.
`device` draws every timed step's batch on the devices
(gem_jax/data/device_synthetic.py: jitted, in the step's shardings, a new key per
step); its generation is inside each timed step (`input_ms_median`: the generator
alone), the warm-up steps still read the source's first batches (the loss check's
reference). Use it when a pool of host batches is too slow to build or too
repetitive (the same few batches' rows in cache); --peer needs `host`.
"""
import argparse
import ast
import json
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help="configs/NAME.py name or a path")
  p.add_argument("--devices", type=int, default=None,
                 help="CPU: simulated devices (default 1); GPU/TPU: the first N devices")
  p.add_argument("--peer", choices=["torchrec"], default=None)
  p.add_argument("--json", action="store_true", help="JSON lines on stdout")
  p.add_argument("--out", default=None, help="append the JSON lines to this file")
  p.add_argument("--steps", type=int, default=20, help="timed steps (>= 20 for reports)")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--pool", type=int, default=4, help="distinct device batches cycled (host)")
  p.add_argument("--input", choices=["host", "device"], default="host",
                 help="host: a pool of the source's batches, put on the devices before "
                      "timing; device: a fresh batch generated on the devices every step")
  p.add_argument("--repeat", type=int, default=1, help="runs (alternating with the peer)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. --set data.batch_size=1024 (Python literal values)")
  p.add_argument("--cache-dir", default=None, help="persistent compile cache (default: fresh)")
  p.add_argument("--no-warm-compile", action="store_true")
  p.add_argument("--no-dense-part", action="store_true", help="skip the dense-only timing")
  p.add_argument("--matmul-ceiling", action="store_true",
                 help="time every dot of the dense part alone: the MFU its shapes allow "
                      "(one device; gem_jax/bench/matmul_ceiling.py); with --peer, torch "
                      "times the same dots (benchmarks/torchrec/matmul.py)")
  p.add_argument("--dump-hlo", default=None, help="write the compiled step's HLO text here")
  p.add_argument("--trace", default=None, metavar="DIR",
                 help="after the timing, a jax.profiler trace of 3 more steps into DIR and "
                      "the top ops by time (JSON: trace_top, trace_by_kind)")
  p.add_argument("--peer-threads", type=int, default=2)
  p.add_argument("--peer-python", default=None,
                 help="TorchRec venv python (default $GEM_JAX_TORCHREC_PYTHON, else "
                      "~/.cache/gem_jax/torchrec-venv/bin/python)")
  p.add_argument("--peer-script", default=None,
                 help="another peer script taking the same flags (default "
                      "benchmarks/torchrec/bench.py; e.g. ../shared/peers/torchrec_bench.py)")
  p.add_argument("--peer-autocast", choices=["auto", "bf16", "off"], default="auto",
                 help="peer precision; auto: gem_jax's (bf16/fp8 compute -> bf16, fp32 -> off)")
  p.add_argument("--no-hugepages", action="store_true",
                 help="under glibc's malloc, keep 4 KiB host pages (default: the script "
                      "re-executes itself under its host malloc (GEM_JAX_MALLOC), glibc's "
                      "asked for huge pages; the peer inherits it: gem_jax/hostmem.py)")
  return p.parse_args(argv)


def _overrides(items):
  out = {}
  for item in items:
    key, _, raw = item.partition("=")
    try:
      out[key.strip()] = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      out[key.strip()] = raw
  return out


def _precisions(config, autocast: str) -> dict:
  """Both sides' precision in words; like for like when the dense compute dtypes agree."""
  m = config.model
  gem = "fp8" if m.get("fp8", False) else (
      "bf16" if str(m.dtype) in ("bfloat16", "bf16") else str(m.dtype).replace("float", "fp"))
  return {"gem_jax": f"{gem} compute (fp32 weights, tables, optimizer)",
          "torchrec": ("bf16 autocast (fp32 tables, optimizer, loss)" if autocast == "bf16"
                       else "fp32"),
          "like_for_like": (gem == "bf16") == (autocast == "bf16") and gem in ("bf16", "fp32")}


def main(argv=None):
  args = parse_args(argv)
  if args.peer and args.input != "host":
    raise SystemExit("--peer compares both sides on the same arrays: use --input host")
  n = args.devices or 1
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  import jax  # noqa: E402  pylint: disable=import-outside-toplevel
  from gem_jax.bench import peer as peer_lib  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import report_table  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import runner  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import trace_summary  # pylint: disable=import-outside-toplevel

  n = args.devices or (1 if jax.default_backend() == "cpu" else jax.device_count())
  if args.matmul_ceiling and n != 1:
    raise SystemExit(f"--matmul-ceiling times one device's dots: use --devices 1, not {n}")
  name = os.path.basename(args.config)[:-3] if args.config.endswith(".py") else args.config
  opts = runner.BenchOptions(steps=args.steps, warmup=args.warmup, pool=args.pool,
                             input=args.input,
                             cache_dir=args.cache_dir, warm_compile=not args.no_warm_compile,
                             dense_part=not args.no_dense_part, dump_hlo=args.dump_hlo,
                             matmul_ceiling=args.matmul_ceiling, trace_dir=args.trace)
  rows = []

  def emit(row):
    rows.append(row)
    line = json.dumps(row, default=float)
    if args.json:
      print(line, flush=True)
    if args.out:
      with open(args.out, "a", encoding="utf-8") as f:
        f.write(line + "\n")

  for r in range(args.repeat):
    config = runner.fit_mesh(runner.load_config(args.config, _overrides(args.set)), n)
    res = runner.run_benchmark(config, opts, name=name)
    res["repeat"] = r
    emit(res)
    print(report_table.format_run(res), file=sys.stderr, flush=True)
    if res.get("trace_top"):
      print(trace_summary.format_top(res["trace_top"]), file=sys.stderr, flush=True)
    if res.get("matmul_top"):
      print(report_table.format_matmuls(res["matmul_top"]), file=sys.stderr, flush=True)
    if args.peer:
      autocast = (peer_lib.peer_autocast(config) if args.peer_autocast == "auto"
                  else args.peer_autocast)
      precision = _precisions(config, autocast)
      cmd = peer_lib.peer_command_from_config(config, steps=max(args.steps, 20), warmup=5,
                                              threads=args.peer_threads, python=args.peer_python,
                                              script=args.peer_script, autocast=autocast)
      print(f"precision: gem_jax {precision['gem_jax']}, TorchRec {precision['torchrec']}"
            f" ({'like for like' if precision['like_for_like'] else 'NOT like for like'})",
            file=sys.stderr, flush=True)
      print("peer: " + " ".join(cmd), file=sys.stderr, flush=True)
      out = peer_lib.run_peer(cmd)
      out.update(name=name, repeat=r, loadavg_after=runner.timing.loadavg())
      emit(out)
      print(report_table.format_peer(out), file=sys.stderr, flush=True)
      if res.get("matmul_dots"):  # the same dots timed by torch (oneDNN) in the peer's venv
        m = peer_lib.matmul_side_by_side(res["matmul_dots"], peer_lib.peer_dot_times(
            res["matmul_dots"], threads=args.peer_threads, python=args.peer_python))
        m.update(name=name, repeat=r)
        emit(m)
        print(report_table.format_matmul_side_by_side(m), file=sys.stderr, flush=True)
  if args.peer:
    summary = report_table.side_by_side(rows)
    summary["precision"] = precision
    emit(summary)
    print(report_table.format_summary(summary) + "; "
          + ("like for like" if precision["like_for_like"] else "NOT like for like")
          + f": gem_jax {precision['gem_jax']} vs TorchRec {precision['torchrec']}",
          file=sys.stderr, flush=True)
  return rows


if __name__ == "__main__":
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  from gem_jax import hostmem  # pylint: disable=import-outside-toplevel
  hostmem.use_host_malloc("--no-hugepages" not in sys.argv)
  main()
