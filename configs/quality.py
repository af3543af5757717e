"""quality: the model-quality benchmark's run config (planted CTR data with a known optimum).

scripts/quality_benchmark.py trains every model (lr, fm, fwfm, dlrm, dcnv2, gem; the
`--config.model.name=` of each run) with this config on the Criteo-format rows that
gem_jax/bench/planted_ctr.py writes, and compares their eval AUC / log loss with the
oracle's. It sets data.train / data.eval to the generated files, seed to the
generator's seed, and train.steps = train rows // data.batch_size: one pass over the
training rows (iid, so no shuffling), one evaluation and one checkpoint at the end.

  python scripts/quality_benchmark.py --kinds pairs,triples --rows 1000000 --out runs/quality
  python scripts/train.py --config configs/quality.py --workdir runs/q_pairs_fm \
    --config.data.train=runs/quality/data/pairs_1000000_e100000_s0/train.tsv \
    --config.data.eval=runs/quality/data/pairs_1000000_e100000_s0/eval.tsv \
    --config.train.steps=3906 --config.model.name=fm                  # one run by hand

`model.overrides` starts empty and train.py locks the config, so its fields cannot come as
`--config.model.overrides.K=V` flags; they come as JSON after the path instead:
`--config 'configs/quality.py:{"d_model": 32, "num_blocks": 2}'` (the benchmark script
turns `--config.model.overrides.K=V` in its --extra / --variant into this).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base  # noqa: E402  pylint: disable=wrong-import-position  (configs/base.py: the schema)

NEVER = 1 << 30  # eval / checkpoint interval: only the forced ones at the last step


def get_config(model_overrides: str = ""):
  """The run config; `model_overrides`: a JSON object of model-config fields (may be empty)."""
  c = base.get_config()
  c.mesh = (1, 1)
  c.data.update(kind="criteo", train="", eval="", batch_size=256, shuffle_buffer=0,
                vocab_size=1 << 15)  # hash buckets per field: the 5-200-value fields fit
  c.train.update(eval_every=NEVER, checkpoint_every=NEVER, log_every=250)
  if model_overrides:
    c.model.overrides.update(json.loads(model_overrides))
  return c
