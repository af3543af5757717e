"""small: the CPU demo. Learns the planted signal of the synthetic 'small' dataset.

  python scripts/train.py --config configs/small.py --workdir runs/small
  python scripts/evaluate.py --config configs/small.py --workdir runs/small

Runs on 2 CPU cores with 8 simulated devices as a 2 x 4 (replica x shard) mesh
and ends with eval AUC, the oracle AUC of the data and the share of the gap
closed, (AUC - 0.5) / (oracle - 0.5) (`auc_gap_closed` in the final JSON line).

Budget: 250 steps of global batch 1024 = 256k rows, one pass (batch 1024
amortises the per-step overhead of 8 simulated devices; dense AdamW lr 4e-3,
10 warm-up steps, cosine; row-wise Adagrad lr 0.3 for the tables). The
synthetic 'small' preset is built to be learnable from exactly these rows: a
logistic regression given the true structure closes 99% (click) / 95%
(conversion) of the AUC gap from them (tests/test_synthetic.py, slow).

Measured end to end (train + evaluate, this commit) on a shared 2-core
machine whose load average was 21-34 (other jobs), i.e. with a fraction of
the 2 cores: compile 197 s (lower 45 s + XLA 152 s), 120-230 examples/s while
loaded and 630 examples/s over the last 25 steps as the load fell to 6; train
loop 23 min, whole command 28.4 min. Eval AUC on 20k rows (click / conversion
/ mean) against the oracle 0.896 / 0.846 / 0.871:
  step 125 (128k rows)  0.825 / 0.780 / 0.802   82% of the gap
  step 250 (256k rows)  0.836 / 0.790 / 0.813   84% (85% click, 84% conversion)
The 90% mark is NOT reached. The data is not the limit: a logistic
regression given the true structure closes 97% of the mean gap from the same
256k rows. GEM learns that structure (pairwise interactions, dense product,
sequence matches) from embeddings less efficiently, and the DLRM baseline
lands at the same place (82% after 128k rows, 84% after 256k). More rows is
the knob (--config.train.steps=500); the earlier preset (rare-value effects,
top-64 ranks and top-16 pairs) reached 77% after 256k rows. At 630 examples/s
(1.6 s per step, load 6) the 256k rows take ~7 min; a run on 2 idle cores
was not measured.

Data: synthetic 'small' (8 pooled features incl. a 4-id bag, 2 event streams of
32 and 64 events, 3 domains, click + conversion). Model: GEM 'small' preset.
Sizes: 305k dense parameters, 100k embedding parameters (8 tables, dim 16);
4.2 MFLOPs forward, 12.7 MFLOPs training FLOPs per example (analytic,
gem_jax.flops; sequences at padded length).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.mesh = (2, -1)

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"
  c.data.preset = "small"
  c.data.train = ""
  c.data.eval = ""
  c.data.batch_size = 1024
  c.data.eval_batch_size = 1024
  c.data.eval_examples = 20_000
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.dtype = "float32"
  c.model.fp8 = False
  c.model.remat = "none"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 16
  c.embedding.optimizer = "rowwise_adagrad"
  c.embedding.lr = 0.3
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "hash"
  c.embedding.memory_budget_gb = 1.0
  c.embedding.share_tables = True

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"
  c.optim.lr = 4e-3
  c.optim.warmup_steps = 10
  c.optim.decay = "cosine"
  c.optim.weight_decay = 0.0
  c.optim.clip_norm = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.steps = 250
  c.train.log_every = 25
  c.train.eval_every = 125
  c.train.eval_batches = 0
  c.train.checkpoint_every = 125
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
