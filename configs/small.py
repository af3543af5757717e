"""small: the CPU demo. Learns the planted signal of the synthetic 'small' dataset.

  python scripts/train.py --config configs/small.py --workdir runs/small
  python scripts/evaluate.py --config configs/small.py --workdir runs/small

Runs on 2 CPU cores with 8 simulated devices as a 2 x 4 (replica x shard) mesh
and ends with eval AUC, the oracle AUC of the data and the share of the gap
closed, (AUC - 0.5) / (oracle - 0.5) (`auc_gap_closed` in the final JSON line).

Measured (2 dedicated cores via taskset, jax 0.11): 650-740 examples/s, compile
17 s; 1000 steps = 256k rows in ~6.5 min. With embedding lr 0.05 the mean eval
AUC over click/conversion was 0.703 / 0.725 / 0.731 / 0.734 after 250 / 500 /
750 / 1000 steps against an oracle of 0.805: 77% of the gap (click alone: 0.794
vs 0.871, 79%). The lr 0.2 + 20 warm-up steps used here gave 0.719 instead of
0.703 at step 250. The 90% mark is NOT reached in a few minutes: the limit is
rows seen, not the model. A logistic regression given the true structure needs
500k rows x 3 epochs for 90% (tests/test_synthetic.py); the DLRM baseline, 10x
faster here, reaches 0.731 after 256k rows and 0.738 after 512k (78%). More
steps (--config.train.steps=4000, ~25 min) is the knob; on a shared, loaded
machine expect ~200 examples/s.

Data: synthetic 'small' (8 pooled features incl. a 4-id bag, 2 event streams of
32 and 64 events, 3 domains, click + conversion). Model: GEM 'small' preset.
Sizes: 237k dense parameters, 100k embedding parameters (8 tables, dim 16);
4.6 MFLOPs forward, 13.8 MFLOPs training FLOPs per example (analytic,
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
