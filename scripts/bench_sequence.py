"""Long-history sequence stack: padded-dense vs chunked vs packed, side by side (issue 19).

  python scripts/bench_sequence.py                       # L = 256, 1024, 4096, 8192
  python scripts/bench_sequence.py --lengths 1024,4096 --layer transformer --batch 4

One JSON line per (L, mode) (gem_jax/bench/sequence.py says what is measured), then one
with the temporaries ratios L=4096 / L=1024 per mode. Runs on one device; on a shared
machine step times are noisy: the figures are medians and each row carries the load.
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gem_jax.bench import sequence  # noqa: E402


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--lengths", default="256,1024,4096,8192")
  ap.add_argument("--modes", default=",".join(sequence.MODES))
  for f in dataclasses.fields(sequence.Setup):
    ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
  args = ap.parse_args(argv)
  setup = sequence.Setup(**{f.name: getattr(args, f.name)
                            for f in dataclasses.fields(sequence.Setup)})
  lengths = [int(x) for x in args.lengths.split(",")]
  rows = []
  for row in sequence.run(setup, lengths, args.modes.split(",")):
    print(json.dumps(row), flush=True)
    rows.append(row)
  if 1024 in lengths and 4096 in lengths:
    print(json.dumps({"temp_ratio_4096_over_1024": sequence.ratios(rows, 1024, 4096)}))
  return rows


if __name__ == "__main__":
  main()
