"""Projects step time, examples/s and end-to-end MFU from 8 to 4,096 GPUs for a config.

  python scripts/project_scale.py --config large                  # H200 defaults, 45 % device MFU
  python scripts/project_scale.py --config medium --from-json gpu_medium.jsonl
  python scripts/project_scale.py --config small --check-cpu      # measured vs projected, 1x8 / 2x4
  python scripts/project_scale.py --config gem_xl --per-device-batch 512 --comm-from-hlo

Single-device compute time per step at the per-device batch b: from a benchmark
JSON line (--from-json, scaled linearly to b), measured here (--measure), or
train FLOPs x b / (--device-mfu x --peak). Communication: the config's own
embedding plan on each (R, S) mesh plus HSDP volumes (--comm-from-hlo: bytes per
parameter read from the config's compiled train step), through the network model
of gem_jax/bench/network.py (flags below; defaults: H100/H200 NVLink 450 GB/s per
direction, 8 GPUs per node, 400 Gb/s IB per GPU). Weak scaling: b is fixed.
"""
import argparse
import json
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--shard", type=int, default=8, help="HSDP / embedding group size S")
  p.add_argument("--per-device-batch", type=int, default=None,
                 help="default: config batch / 8 (one node)")
  p.add_argument("--device-mfu", type=float, default=0.45,
                 help="single-device MFU assumed when nothing is measured")
  p.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s per GPU (H200 bf16)")
  p.add_argument("--from-json", default=None, help="benchmark JSONL: last gem_jax line is used")
  p.add_argument("--measure", action="store_true", help="measure the 1-device step here")
  p.add_argument("--intra-bw", type=float, default=450e9)
  p.add_argument("--inter-bw", type=float, default=50e9)
  p.add_argument("--intra-lat", type=float, default=3e-6)
  p.add_argument("--inter-lat", type=float, default=10e-6)
  p.add_argument("--gpus-per-node", type=int, default=8)
  p.add_argument("--param-bytes", type=int, default=4,
                 help="bytes per gathered dense param (assumed: two gathers per step)")
  p.add_argument("--comm-from-hlo", action="store_true",
                 help="HSDP bytes per dense param from the config's own train step, "
                      "compiled for a 2x4 CPU mesh (gem_jax/bench/collectives.py)")
  p.add_argument("--min-devices", type=int, default=8)
  p.add_argument("--max-devices", type=int, default=4096)
  p.add_argument("--check-cpu", action="store_true",
                 help="measured vs projected step on 1x8 and 2x4 CPU meshes")
  p.add_argument("--check-steps", type=int, default=20)
  p.add_argument("--cpu-bw", type=float, default=5e9, help="CPU 'link' (memcpy) bytes/s")
  p.add_argument("--cpu-lat", type=float, default=20e-6)
  p.add_argument("--json", action="store_true")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  if args.check_cpu or args.comm_from_hlo:
    from gem_jax import hostmem  # pylint: disable=import-outside-toplevel
    hostmem.simulate_cpu_devices()
  from gem_jax.bench import projection  # pylint: disable=import-outside-toplevel
  out = projection.run(args)
  if args.json:
    for row in out["rows"] + out.get("check", []):
      print(json.dumps(row, default=float))
  return out


if __name__ == "__main__":
  main()
