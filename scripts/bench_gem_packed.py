"""GEM end to end on padded vs packed histories, one training step side by side (issue 19).

  python scripts/bench_gem_packed.py                     # batch 16, L = 1024, d_model 32
  python scripts/bench_gem_packed.py --max_len 4096 --batch 8

One JSON line per mode (gem_jax/bench/gem_packed.py says what is measured), then the
packed / padded ratios. One device; the rows carry the machine load.
"""
import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gem_jax.bench import gem_packed  # noqa: E402


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for f in dataclasses.fields(gem_packed.Setup):
    ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
  args = ap.parse_args(argv)
  setup = gem_packed.Setup(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(gem_packed.Setup)})
  rows = gem_packed.run(setup)
  for row in rows:
    print(json.dumps(row), flush=True)
  pad, pk = rows
  print(json.dumps({"packed_over_padded": {
      "real_events_per_s": round(pk["real_events_per_s"] / pad["real_events_per_s"], 2),
      "temp_mb": round(pk["temp_mb"] / pad["temp_mb"], 2),
      "computed_tokens": round(pk["computed_tokens"] / pad["computed_tokens"], 2)}}))
  return rows


if __name__ == "__main__":
  main()
