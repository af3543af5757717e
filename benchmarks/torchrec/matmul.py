"""torch's time for each of a list of dots: the peer's side of `--matmul-ceiling --peer torchrec`.

  python benchmarks/torchrec/matmul.py DOTS.json [--threads 2]

DOTS.json is a list of dots as gem_jax's step traces them
(gem_jax.bench.matmul_ceiling.DotShape, written by gem_jax.bench.peer.peer_dot_times):

  [{"lhs": [4096, 576], "rhs": [576, 512], "contract": [[1], [0]], "batch": [[], []],
    "dtype": "bfloat16"}, ...]

Each is run as `torch.einsum` on contiguous tensors of those shapes and that dtype
(bf16 x bf16 -> bf16 with fp32 accumulation inside oneDNN, as under the peer's
torch.autocast; fp32 x fp32 -> fp32; "ms": null for a dtype without a like-for-like
torch dot, e.g. mixed operands), the way the peer's own forward and backward
run them: torch picks the kernel and any transposed view itself. Time per call is
the median over `--repeats` samples of back-to-back calls (>= `--min-seconds` each).
Prints one JSON line: {"threads", "torch", "dots": [{..., "ms": t}]}.
"""
from __future__ import annotations

import argparse
import json
import string
import sys
import time


def einsum_spec(lhs_rank: int, rhs_rank: int, contract, batch) -> str:
  """The einsum of a dot_general: batch dims, then lhs free, then rhs free (XLA's order).

  einsum_spec(2, 2, [[1], [0]], [[], []]) == 'ab,bc->ac'
  einsum_spec(2, 2, [[0], [0]], [[], []]) == 'ab,ac->bc'   (x^T g: contract the rows)
  """
  (lc, rc), (lb, rb) = contract, batch
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"dimension numbers {contract}, {batch}: lhs and rhs lists differ in length")
  letters = iter(string.ascii_lowercase)
  lhs, rhs = [None] * lhs_rank, [None] * rhs_rank
  for i, j in zip(lb, rb):
    lhs[i] = rhs[j] = next(letters)
  for i, j in zip(lc, rc):
    lhs[i] = rhs[j] = next(letters)
  for arr in (lhs, rhs):
    for k, v in enumerate(arr):
      if v is None:
        arr[k] = next(letters)
  out = [lhs[i] for i in lb]
  out += [v for k, v in enumerate(lhs) if k not in lb and k not in lc]
  out += [v for k, v in enumerate(rhs) if k not in rb and k not in rc]
  return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def time_dot(torch, dot: dict, repeats: int, min_seconds: float) -> float | None:
  """Median seconds of one torch.einsum of `dot`; None for a dtype torch has no like for."""
  dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
           "float16": torch.float16}.get(dot["dtype"])
  if dtype is None:
    return None
  gen = torch.Generator().manual_seed(0)
  a = torch.randn(*dot["lhs"], generator=gen).to(dtype)
  b = torch.randn(*dot["rhs"], generator=gen).to(dtype)
  spec = einsum_spec(len(dot["lhs"]), len(dot["rhs"]), dot["contract"], dot["batch"])
  with torch.no_grad():
    torch.einsum(spec, a, b)
    t0 = time.perf_counter()
    torch.einsum(spec, a, b)
    inner = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      for _ in range(inner):
        torch.einsum(spec, a, b)
      samples.append((time.perf_counter() - t0) / inner)
  samples.sort()
  return samples[len(samples) // 2]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dots", help="JSON file: a list of dots")
  p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--min-seconds", type=float, default=0.02)
  args = p.parse_args(argv)
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(args.threads)
  with open(args.dots, encoding="utf-8") as f:
    dots = json.load(f)
  out = []
  for d in dots:
    t = time_dot(torch, d, args.repeats, args.min_seconds)
    out.append(dict(d, ms=None if t is None else 1e3 * t))
  print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                    "dots": out}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
