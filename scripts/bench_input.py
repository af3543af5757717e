"""Input pipeline benchmark (issue 23): text reader, converter, Parquet reader, step, bytes.

  python scripts/bench_input.py                        # 1M planted 'heavy' rows, temp dir
  python scripts/bench_input.py --rows 200000 --repeat 1 --workers 2 --out bench.jsonl
  python scripts/bench_input.py --tsv /data/criteo/day_0 --workdir /tmp/bench_input

Measures in one run, on one process (rows/s are per process; medians over --repeat):
  (a) text: `CriteoSource(tsv).batches(B, repeat=False)`, host batches in file order;
  (b) convert: `convert.convert(CriteoSource(tsv), ...)` with workers=1 in this process,
      workers=1 in a child pinned to one core (`taskset -c CORE`, else sched_setaffinity;
      the 300k rows/s target is for one core) and, with --workers N, N parser threads;
  (c) reader: `ParquetSource(...).batches(B, repeat=False)` -> ready host batches, with
      configs/criteo.py's shuffle_buffer and without, at 1, 2 and 4 reader workers;
      the ratio to (a) at the trainer's defaults (criteo shuffle, data.reader_workers);
  (d) step: the jitted train step of configs/dlrm_peer.py (its model; data block: the
      converted dataset, data.kind='criteo', hashed ids) on one device, fed by the
      trainer's path (ParquetSource -> Prefetcher(size=2) + setup.device_putter), by
      device-side batches (gem_jax/data/device_synthetic.py via bench.runner.device_input,
      same spec, plan and shardings) and by 4 reader batches already on the device (the
      step alone), interleaved: median step time of each (a step is timed from asking for
      its batch to its outputs being ready), the ratios, the fraction of reader-fed steps
      that spent > --wait-ms in next(prefetcher), and the fraction that found the
      prefetcher's queue empty (really waited for a batch);
  (e) bytes: P = 1, 2, 4 iterators (process_index 0..P-1, this process) over one epoch
      (repeat=False, criteo shuffle): each one's `bytes_read` / total, the largest
      |share P - 1|, and whether the concatenated local batches equal P = 1's, bit for bit.

Input: --tsv PATH (Criteo TSV, gzip or plain), else --rows rows of
gem_jax.bench.planted_ctr kind --kind (default 'heavy': 6 fields of 1e5-1e6 values, so the
Parquet files are as large as real ones) written to --workdir (default: a temp dir,
removed at the end). Row groups: rows // 64 (at most 65536), so (e) has 16 per process at
P = 4. Prints a table (stderr) and one JSON line (stdout; --out FILE appends it).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

READER_WORKERS = (1, 2, 4)
PROCESS_COUNTS = (1, 2, 4)
TARGETS = {"convert_1core_rows_per_s": 300_000, "reader_rows_per_s": 1_000_000,
           "reader_vs_text": 20.0, "bytes_max_dev": 0.10, "step_ratio": 1.05}


def one_cpu_device() -> None:
  """XLA_FLAGS for one CPU device (must precede `import jax`)."""
  if "jax" in sys.modules:
    return
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1".strip()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", type=int, default=1_000_000, help="planted rows (without --tsv)")
  p.add_argument("--tsv", default=None, help="Criteo TSV file(s) instead of planted rows")
  p.add_argument("--kind", default="heavy", help="gem_jax.bench.planted_ctr kind")
  p.add_argument("--workdir", default=None, help="keep data here (default: temp, removed)")
  p.add_argument("--repeat", type=int, default=3, help="runs per measurement (medians)")
  p.add_argument("--batch-size", type=int, default=4096, help="host batch of (a), (c), (e)")
  p.add_argument("--step-batch", type=int, default=4096, help="global batch of (d)")
  p.add_argument("--steps", type=int, default=20, help="timed steps per run of (d)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps per run of (d)")
  p.add_argument("--wait-ms", type=float, default=1.0,
                 help="(d): a step waited for input when next(prefetcher) took longer")
  p.add_argument("--workers", type=int, default=None, help="(b): also N parser threads")
  p.add_argument("--pin-core", type=int, default=0, help="(b): the one core")
  p.add_argument("--vocab", type=int, default=100_000,
                 help="table rows per feature (data.vocab_size; dlrm_peer: 100k)")
  p.add_argument("--row-group-rows", type=int, default=None, help="default rows // 64")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="append the JSON line to this file")
  p.add_argument("--convert-child", default=None, help=argparse.SUPPRESS)  # internal
  return p.parse_args(argv)


def median(xs):
  xs = sorted(xs)
  n = len(xs)
  return float("nan") if not n else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


def machine() -> dict:
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = None
  return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
          "loadavg": load, "python": sys.version.split()[0], "commit": _commit()}


def _commit() -> str | None:
  """HEAD of the checkout, '+' when gem_jax/data has uncommitted changes."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "gem_jax/data"], cwd=ROOT,
                           text=True, capture_output=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+" if dirty else "")


# ------------------------------------------------------------------------- (a) --

def text_pass(tsv, batch: int, vocab: int) -> tuple[int, float]:
  """(rows, seconds) of one pass of the text reader's host batches, file order."""
  from gem_jax.data.criteo import CriteoSource  # pylint: disable=import-outside-toplevel
  it = CriteoSource(tsv, vocab_size=vocab).batches(batch, repeat=False)
  rows, t0 = 0, time.perf_counter()
  for b in it:
    rows += int(b["label_mask"].sum())
  dt = time.perf_counter() - t0
  getattr(it, "close", lambda: None)()
  return rows, dt


# ------------------------------------------------------------------------- (b) --

def convert_once(tsv, out: str, *, rg: int, workers: int, vocab: int) -> tuple[dict, float]:
  """(metadata, seconds) of converting `tsv` into `out` (replaced)."""
  from gem_jax.data import convert  # pylint: disable=import-outside-toplevel
  from gem_jax.data.criteo import CriteoSource  # pylint: disable=import-outside-toplevel
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.perf_counter()
  meta = convert.convert(CriteoSource(tsv, vocab_size=vocab), out, kind="criteo",
                         options={"vocab_size": vocab, "int_buckets": False},
                         row_group_rows=rg, rows_per_file=max(rg, 1 << 20), workers=workers)
  return meta, time.perf_counter() - t0


def convert_pinned(args, tsv, out: str, rg: int) -> tuple[float, str]:
  """(seconds, how) of one workers=1 conversion in a child process on one core."""
  child = [sys.executable, os.path.abspath(__file__), "--convert-child", out,
           "--tsv", tsv, "--vocab", str(args.vocab), "--row-group-rows", str(rg)]
  if shutil.which("taskset"):
    cmd, how = ["taskset", "-c", str(args.pin_core), *child], f"taskset -c {args.pin_core}"
  else:
    cmd, how = child + ["--pin-core", str(args.pin_core)], f"affinity {{{args.pin_core}}}"
  out_ = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if out_.returncode:
    raise RuntimeError(f"pinned conversion failed: {out_.stderr[-2000:]}")
  return json.loads(out_.stdout.strip().splitlines()[-1])["seconds"], how


def convert_child(args) -> None:
  if not shutil.which("taskset"):
    os.sched_setaffinity(0, {args.pin_core})   # before pyarrow starts any thread
  meta, dt = convert_once(args.tsv, args.convert_child, rg=args.row_group_rows, workers=1,
                          vocab=args.vocab)
  print(json.dumps({"rows": meta["rows"], "seconds": dt,
                    "cpus": sorted(os.sched_getaffinity(0))}))


# ------------------------------------------------------------------------- (c) --

def reader_pass(path: str, batch: int, shuffle: int, workers: int, seed: int
                ) -> tuple[int, float]:
  """(rows, seconds) of one epoch of ready host batches of the Parquet reader."""
  from gem_jax.data.parquet import ParquetSource  # pylint: disable=import-outside-toplevel
  src = ParquetSource(path, shuffle_buffer=shuffle, workers=workers)
  rows, t0 = 0, time.perf_counter()
  it = src.batches(batch, seed=seed, repeat=False)
  for b in it:
    rows += int(b["label_mask"].sum())
  dt = time.perf_counter() - t0
  it.close()
  return rows, dt


# ------------------------------------------------------------------------- (e) --

def _digest(parts: list) -> str:
  import hashlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gem_jax.data import columnar  # pylint: disable=import-outside-toplevel
  flat = [columnar.flatten(p) for p in parts]
  h = hashlib.sha256()
  for k in sorted(flat[0]):
    x = np.ascontiguousarray(np.concatenate([f[k] for f in flat]))
    h.update(f"{k}|{x.dtype.str}|{x.shape}".encode())
    h.update(x.tobytes())
  return h.hexdigest()


def bytes_per_process(path: str, batch: int, shuffle: int, seed: int) -> dict:
  """{P: shares, deviation, identical} for P in PROCESS_COUNTS, one epoch each."""
  from gem_jax.data.parquet import ParquetSource  # pylint: disable=import-outside-toplevel
  src = ParquetSource(path, shuffle_buffer=shuffle, workers=2)
  ref, out = None, {}
  for P in PROCESS_COUNTS:
    its = [src.batches(batch, process_index=p, process_count=P, seed=seed, repeat=False)
           for p in range(P)]
    digests, ends = [], set()
    while True:
      got = []
      for it in its:
        try:
          got.append(next(it))
        except StopIteration:
          got.append(None)
      ends = {g is None for g in got}
      if True in ends:
        break
      digests.append(_digest(got))
    nbytes = [it.bytes_read for it in its]
    for it in its:
      it.close()
    total = sum(nbytes)
    shares = [b / total for b in nbytes]
    if ref is None:
      ref = (digests, total)
    out[P] = {"bytes": nbytes, "shares": [round(s, 4) for s in shares],
              "max_dev": max(abs(s * P - 1) for s in shares),
              "total_vs_p1": total / ref[1], "batches": len(digests),
              "same_end": ends == {True},
              "identical": ends == {True} and digests == ref[0]}
  return out


# ------------------------------------------------------------------------- (d) --

def step_comparison(args, dataset: str, shuffle: int) -> dict:
  """dlrm_peer's train step fed by the reader (trainer path) vs device-side batches."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import runner  # pylint: disable=import-outside-toplevel
  from gem_jax.bench import timing  # pylint: disable=import-outside-toplevel
  from gem_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  from gem_jax.train import report  # pylint: disable=import-outside-toplevel
  from gem_jax.train import setup as setup_lib  # pylint: disable=import-outside-toplevel
  from gem_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  b = args.step_batch
  total = 3 * args.repeat * (args.steps + args.warmup) + 8   # the lr schedule's length
  config = runner.fit_mesh(runner.load_config("dlrm_peer", {
      "data.kind": "criteo", "data.train": dataset, "data.eval": dataset,
      "data.vocab_size": args.vocab, "data.shuffle_buffer": shuffle, "data.batch_size": b,
      "data.eval_batch_size": b, "data.eval_examples": b, "embedding.id_policy": "hash",
      "train.steps": total}), 1)
  s = setup_lib.setup(config)
  state = setup_lib.init_state(s, config.seed)
  it = s.train_src.batches(b, process_index=0, process_count=1, seed=config.seed, repeat=True)
  prefetcher = pipeline.Prefetcher(it, put_fn=setup_lib.device_putter(s.plan, s.mesh, None),
                                   size=2)
  first = next(prefetcher)
  batch_sh = jax.tree.map(lambda x: x.sharding, first)
  step_fn, compile_t = report.timed_compile(
      step_lib.jit_train_step(s.step_cfg, s.shardings, batch_sh, skip_nonfinite=True),
      state, first)
  gen = runner.device_input(s, config, first)
  jax.block_until_ready(gen(2**31 - 1))   # compiled, first run untimed
  pool = [first] + [next(prefetcher) for _ in range(3)]   # on the device: the step alone
  key = [0]

  def reader_batch():
    return next(prefetcher)

  def device_batch():
    key[0] += 1
    return gen(key[0])

  def pool_batch():
    key[0] += 1
    return pool[key[0] % len(pool)]

  queue = getattr(prefetcher, "_q", None)   # a peek at its read-ahead (no public accessor)

  def run(get):
    nonlocal state
    times, waits, losses = [], [], []
    for i in range(args.warmup + args.steps):
      if get is reader_batch and i >= args.warmup and queue is not None:
        empty.append(queue.qsize() == 0)
      t0 = time.perf_counter()
      batch = get()
      t1 = time.perf_counter()
      state, metrics = step_fn(state, batch)
      jax.block_until_ready((state, metrics))
      t2 = time.perf_counter()
      if i >= args.warmup:
        times.append(t2 - t0)
        waits.append(t1 - t0)
        losses.append(float(metrics["train_loss"]))
    return times, waits, losses

  feeds = {"reader": reader_batch, "device": device_batch, "pool": pool_batch}
  per = {k: [] for k in feeds}
  waits_all, empty, losses = [], [], {k: [] for k in feeds}
  try:
    for _ in range(args.repeat):      # interleaved, so all see the same machine load
      for name, get in feeds.items():
        t, w, l = run(get)
        per[name].append(t)
        losses[name] += l
        if name == "reader":
          waits_all += w
    gen_ms = 1e3 * median([t for _ in range(args.repeat) for t in timing.time_steps(
        lambda i: gen(10**6 + i), args.steps, jax.block_until_ready)])
  finally:
    prefetcher.close()
    it.close()
  med = {k: 1e3 * median([float(np.median(t)) for t in v]) for k, v in per.items()}
  thr = args.wait_ms / 1e3
  reader_total = sum(sum(t) for t in per["reader"])
  return {"config": "dlrm_peer", "batch_size": b, "steps": args.steps, "warmup": args.warmup,
          "tables": len(s.plan.tables), "table_rows": args.vocab,
          "reader_workers": int(config.data.reader_workers), "shuffle_buffer": shuffle,
          "compile_s": compile_t.lower_s + compile_t.compile_s,
          "reader_step_ms": med["reader"], "device_step_ms": med["device"],
          "pool_step_ms": med["pool"], "device_gen_ms": gen_ms,
          **{f"{k}_step_ms_runs": [1e3 * float(np.median(t)) for t in v] for k, v in per.items()},
          "ratio": med["reader"] / med["device"], "ratio_vs_pool": med["reader"] / med["pool"],
          "wait_ms_threshold": args.wait_ms,
          "waited_fraction": float(np.mean(np.asarray(waits_all) > thr)),
          "wait_ms_median": 1e3 * float(np.median(waits_all)),
          "starved_fraction": float(np.mean(empty)) if empty else None,
          "wait_share_of_time": float(sum(waits_all) / reader_total),
          "loss_reader_last": losses["reader"][-1], "loss_device_last": losses["device"][-1],
          "finite": bool(all(np.all(np.isfinite(v)) for v in losses.values()))}


# ------------------------------------------------------------------------ main --

def _rate(results) -> dict:
  """{'rows_per_s': median, 'runs': [...], 'rows': n} of [(rows, seconds)]."""
  rates = [r / s for r, s in results]
  return {"rows_per_s": median(rates), "runs": [round(x) for x in rates],
          "rows": results[0][0]}


def run(args) -> dict:
  t_start = time.perf_counter()
  header = machine()
  print(f"bench_input: {header['cpu_count']} CPUs ({header['cpus_usable']} usable), load "
        f"average {header['loadavg']}, repeat {args.repeat}", file=sys.stderr, flush=True)
  tmp = None
  work = args.workdir
  if work is None:
    tmp = work = tempfile.mkdtemp(prefix="bench_input_")
  os.makedirs(work, exist_ok=True)
  try:
    return _run(args, work, header, t_start)
  finally:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)


def _log(msg: str) -> None:
  print(f"  {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def _run(args, work: str, header: dict, t_start: float) -> dict:
  from gem_jax.bench import planted_ctr  # pylint: disable=import-outside-toplevel
  if args.tsv:
    tsv, source = args.tsv, {"tsv": args.tsv}
  else:
    meta = planted_ctr.write(os.path.join(work, f"tsv_{args.kind}_{args.rows}"), args.kind,
                             args.seed, args.rows, 1000)
    tsv, source = meta["train"], {"planted": args.kind, "seed": args.seed}
  from gem_jax.data import files  # pylint: disable=import-outside-toplevel
  tsv_list = files.expand_paths(tsv)
  lines = sum(files.count_lines(p) for p in tsv_list)
  tsv_bytes = sum(os.path.getsize(p) for p in tsv_list)
  rg = args.row_group_rows or max(1, min(65536, lines // 64))
  res: dict = {"bench": "input", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), **header,
               **source, "rows": lines, "tsv_bytes": tsv_bytes, "row_group_rows": rg,
               "batch_size": args.batch_size, "repeat": args.repeat}
  _log(f"{lines:,} rows ({tsv_bytes / 2**20:.1f} MiB TSV), row groups of {rg:,}")

  # (a) text reader
  res["text"] = _rate([text_pass(tsv, args.batch_size, args.vocab)
                       for _ in range(args.repeat)])
  _log(f"(a) text reader {res['text']['rows_per_s']:,.0f} rows/s")

  # (b) converter
  dataset = os.path.join(work, "parquet")
  conv = []
  for _ in range(args.repeat):
    meta, dt = convert_once(tsv, dataset, rg=rg, workers=1, vocab=args.vocab)
    conv.append((meta["rows"], dt))
  res["convert"] = _rate(conv)
  res["parquet_bytes"] = sum(f["bytes"] for f in meta["files"])
  res["row_groups"] = sum(len(f["row_groups"]) for f in meta["files"])
  res["bad_rows"] = meta["bad_rows"]["bad"]
  _log(f"(b) converter {res['convert']['rows_per_s']:,.0f} rows/s (workers=1)")
  pinned = []
  for _ in range(args.repeat):
    dt, how = convert_pinned(args, tsv, os.path.join(work, "parquet_pinned"), rg)
    pinned.append((meta["rows"], dt))
  res["convert_1core"] = {**_rate(pinned), "how": how}
  _log(f"(b) converter {res['convert_1core']['rows_per_s']:,.0f} rows/s (one core, {how})")
  if args.workers:
    res["convert_workers"] = {**_rate([
        (meta["rows"], convert_once(tsv, os.path.join(work, "parquet_w"), rg=rg,
                                    workers=args.workers, vocab=args.vocab)[1])
        for _ in range(args.repeat)]), "workers": args.workers}
    _log(f"(b) converter {res['convert_workers']['rows_per_s']:,.0f} rows/s "
         f"(workers={args.workers})")
  shutil.rmtree(os.path.join(work, "parquet_pinned"), ignore_errors=True)
  shutil.rmtree(os.path.join(work, "parquet_w"), ignore_errors=True)

  # (c) reader
  from gem_jax.bench import runner  # pylint: disable=import-outside-toplevel
  criteo_data = runner.load_config("criteo").data
  shuffle, default_workers = int(criteo_data.shuffle_buffer), int(criteo_data.reader_workers)
  reader = {}
  for name, buf in (("shuffled", shuffle), ("file_order", 0)):
    for w in sorted({*READER_WORKERS, default_workers}):
      reader[f"{name}_w{w}"] = _rate([reader_pass(dataset, args.batch_size, buf, w, args.seed)
                                      for _ in range(args.repeat)])
      _log(f"(c) reader {name} workers={w}: {reader[f'{name}_w{w}']['rows_per_s']:,.0f} rows/s")
  res["reader"] = reader
  res["reader_shuffle_buffer"] = shuffle
  res["reader_default"] = f"shuffled_w{default_workers}"
  res["reader_rows_per_s"] = reader[res["reader_default"]]["rows_per_s"]
  res["reader_vs_text"] = res["reader_rows_per_s"] / res["text"]["rows_per_s"]

  # (e) bytes per process
  res["bytes_per_process"] = bytes_per_process(dataset, args.batch_size, shuffle, args.seed)
  _log("(e) bytes per process done")

  # (d) step
  res["step"] = step_comparison(args, dataset, shuffle)
  _log(f"(d) step reader {res['step']['reader_step_ms']:.1f} ms, device "
       f"{res['step']['device_step_ms']:.1f} ms")

  bpp = res["bytes_per_process"]
  res["checks"] = {
      "batches_identical_p124": all(v["identical"] for v in bpp.values()),
      "bytes_max_dev": max(v["max_dev"] for v in bpp.values()),
      "step_losses_finite": res["step"]["finite"],
  }
  res["targets"] = {
      "convert_1core_rows_per_s": _target(res["convert_1core"]["rows_per_s"], ">="),
      "reader_rows_per_s": _target(res["reader_rows_per_s"], ">="),
      "reader_vs_text": _target(res["reader_vs_text"], ">="),
      "bytes_max_dev": _target(res["checks"]["bytes_max_dev"], "<="),
      "step_ratio": _target(res["step"]["ratio"], "<="),
  }
  for k, t in res["targets"].items():
    t["target"] = TARGETS[k]
    t["holds"] = t["value"] >= TARGETS[k] if t["op"] == ">=" else t["value"] <= TARGETS[k]
  try:
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    pass
  res["seconds"] = time.perf_counter() - t_start
  return res


def _pct(x) -> str:
  return "n/a" if x is None else f"{100 * x:.0f} %"


def _target(value, op) -> dict:
  return {"value": float(value), "op": op}


def table(res: dict) -> str:
  """The readable summary of a result."""
  def k(x):
    return f"{x / 1e3:,.0f}k"

  text = res["text"]["rows_per_s"]
  lines = [
      f"input benchmark: {res['rows']:,} rows ({res.get('planted', 'tsv')}), "
      f"TSV {res['tsv_bytes'] / 2**20:.1f} MiB -> Parquet {res['parquet_bytes'] / 2**20:.1f} "
      f"MiB in {res['row_groups']} row groups of {res['row_group_rows']:,}; batch "
      f"{res['batch_size']}; {res['cpu_count']} CPUs, load {res['loadavg']} -> "
      f"{res.get('loadavg_after')}; medians of {res['repeat']}; commit {res.get('commit')}",
      "",
      "| measurement | rows/s per process | vs text |",
      "|---|---:|---:|",
      f"| (a) text reader (CriteoSource, file order) | {k(text)} | 1.0x |",
      f"| (b) converter, workers=1 | {k(res['convert']['rows_per_s'])} | "
      f"{res['convert']['rows_per_s'] / text:.1f}x |",
      f"| (b) converter, workers=1, one core ({res['convert_1core']['how']}) | "
      f"{k(res['convert_1core']['rows_per_s'])} | "
      f"{res['convert_1core']['rows_per_s'] / text:.1f}x |",
  ]
  if "convert_workers" in res:
    cw = res["convert_workers"]
    lines.append(f"| (b) converter, workers={cw['workers']} | {k(cw['rows_per_s'])} | "
                 f"{cw['rows_per_s'] / text:.1f}x |")
  for name, r in res["reader"].items():
    order, w = name.rsplit("_w", 1)
    desc = (f"shuffle_buffer={res['reader_shuffle_buffer']}" if order == "shuffled"
            else "file order")
    mark = " (trainer default)" if name == res["reader_default"] else ""
    lines.append(f"| (c) Parquet reader, {desc}, {w} worker{'s' if w != '1' else ''}{mark} | "
                 f"{k(r['rows_per_s'])} | {r['rows_per_s'] / text:.1f}x |")
  st = res["step"]
  lines += [
      "",
      f"(d) dlrm_peer step, batch {st['batch_size']}, {st['tables']} tables x "
      f"{st['table_rows']:,} rows, 1 CPU device, {st['steps']} timed steps x {res['repeat']}:",
      "",
      "| input | step ms (median) | steps that waited > "
      f"{st['wait_ms_threshold']:g} ms | median wait ms | queue empty when asked |",
      "|---|---:|---:|---:|---:|",
      f"| Parquet reader -> Prefetcher + device_putter | {st['reader_step_ms']:.1f} | "
      f"{100 * st['waited_fraction']:.0f} % | {st['wait_ms_median']:.2f} | "
      f"{_pct(st['starved_fraction'])} |",
      f"| device-side synthetic (device_batch_fn; generation {st['device_gen_ms']:.1f} ms "
      f"alone) | {st['device_step_ms']:.1f} | - | - | - |",
      f"| 4 reader batches already on the device, cycled (the step alone) | "
      f"{st['pool_step_ms']:.1f} | - | - | - |",
      f"| ratio reader / device-side | {st['ratio']:.3f} | | | |",
      f"| ratio reader / step alone | {st['ratio_vs_pool']:.3f} | | | |",
      "",
      "(e) bytes read per process, one epoch:",
      "",
      "| P | bytes / total per process | max abs(share P - 1) | total / P=1 | batches = P=1's |",
      "|---:|---|---:|---:|---|",
  ]
  for P, v in res["bytes_per_process"].items():
    lines.append(f"| {P} | {', '.join(f'{s:.3f}' for s in v['shares'])} | "
                 f"{100 * v['max_dev']:.1f} % | {v['total_vs_p1']:.3f} | "
                 f"{'identical' if v['identical'] else 'DIFFERENT'} ({v['batches']}) |")
  lines += ["", "| target | value | holds |", "|---|---:|---|"]
  names = {"convert_1core_rows_per_s": "converter, one core >= 300k rows/s",
           "reader_rows_per_s": "reader >= 1M rows/s",
           "reader_vs_text": "reader >= 20x text reader",
           "bytes_max_dev": "bytes per process within 10 % of 1/P",
           "step_ratio": "step with reader within 5 % of device input"}
  for key, t in res["targets"].items():
    v = t["value"]
    shown = (f"{v:,.0f}" if key.endswith("rows_per_s") else f"{v:.1f}x" if key == "reader_vs_text"
             else f"{100 * v:.1f} %" if key == "bytes_max_dev" else f"{v:.3f}")
    lines.append(f"| {names[key]} | {shown} | {'yes' if t['holds'] else 'NO'} |")
  return "\n".join(lines)


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.convert_child:
    convert_child(args)
    return None
  one_cpu_device()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  res = run(args)
  print(table(res), file=sys.stderr, flush=True)
  line = json.dumps(res, default=float)
  print(line, flush=True)
  if args.out:
    with open(args.out, "a", encoding="utf-8") as f:
      f.write(line + "\n")
  return res


if __name__ == "__main__":
  main()
