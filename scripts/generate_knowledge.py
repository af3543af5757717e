"""Writes a trained teacher's knowledge (logits + chosen embeddings) of a dataset, streaming.

  python scripts/generate_knowledge.py \
    --teacher_config configs/transfer_teacher_planted.py --teacher_workdir runs/teacher \
    --data_config configs/student_planted.py --split train --out runs/knowledge/train

The teacher is restored from its latest checkpoint (or --step) onto its config's
mesh, like training; the data is the `data` block of --data_config (its train or
eval split), read with that config's seed and batch size (the student must read
it the same way). Each process writes its own shards; process 0 writes
index.json. Prints the index as one JSON line. See docs/knowledge_transfer.md.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from gem_jax.data import registry  # noqa: E402
from gem_jax.parallel import distributed  # noqa: E402
from gem_jax.train import predict  # noqa: E402
from gem_jax.transfer import generate  # noqa: E402
from gem_jax.transfer.train import _load_config  # noqa: E402


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--teacher_config", required=True)
  p.add_argument("--teacher_workdir", required=True)
  p.add_argument("--data_config", required=True, help="config file whose `data` block is read")
  p.add_argument("--split", default="train", choices=("train", "eval"))
  p.add_argument("--out", required=True)
  p.add_argument("--fields", default="trunk", help="comma-separated teacher aux outputs")
  p.add_argument("--batch_size", type=int, default=0, help="0: data_config.data.batch_size")
  p.add_argument("--step", type=int, default=None, help="teacher checkpoint step (default: latest)")
  p.add_argument("--rows_per_shard", type=int, default=65536)
  args = p.parse_args(argv)
  distributed.maybe_initialize()
  data_cfg = _load_config(args.data_config)
  b = args.batch_size or data_cfg.data.batch_size
  teacher = predict.restore_model(_load_config(args.teacher_config), args.teacher_workdir, b,
                                  step=args.step)
  train, ev = registry.make_sources(data_cfg.data)
  index = generate.generate_knowledge(
      teacher, train if args.split == "train" else ev, args.out, batch_size=b,
      fields=tuple(f for f in args.fields.split(",") if f), seed=data_cfg.get("seed", 0),
      rows_per_shard=args.rows_per_shard)
  if jax.process_index() == 0:
    print(json.dumps(index), flush=True)
  return index


if __name__ == "__main__":
  main()
