"""small: the CPU demo. Learns the planted signal of the synthetic 'small' dataset.

  python scripts/train.py --config configs/small.py --workdir runs/small
  python scripts/evaluate.py --config configs/small.py --workdir runs/small

Runs on 2 CPU cores with 8 simulated devices as a 2 x 4 (replica x shard) mesh
and ends with eval AUC, the oracle AUC of the data and the share of the gap
closed, (AUC - 0.5) / (oracle - 0.5) (`auc_gap_closed` in the final JSON line).

Budget: 2000 steps of global batch 256 = 512k rows, one pass. Model: GEM
'small' with one InterFormer block (`model.overrides.num_blocks = 1`). Dense
AdamW lr 4e-3, 10 warm-up steps, cosine; row-wise Adagrad lr 1.0 for the
tables; id_policy 'error' (the synthetic ids are exactly 0..vocab-1, so every
value keeps its own row: 'hash', splitmix64(id) mod vocab, fills only ~62% of
the rows and merges values, e.g. 9 of the 16 device values share a row, which
blurs their effects and fakes sequence matches). A logistic regression given
the true structure closes 99% (click) / 98% (conversion) of the AUC gap from
these rows (tests/test_synthetic.py, slow).

Measured end to end (train + evaluate, this commit, the two commands above)
on the shared 2-core machine at load average 3.1-5.9 (other jobs): compile
16 s cold (lower 2.3 s + XLA 13.9 s; 3 s from the persistent cache on a
second start), 1,390-1,640 examples/s (0.17 s per step), train 379 s,
evaluate 10 s, whole 6.5 min. Eval AUC on 20k rows (click / conversion /
mean) against the oracle 0.896 / 0.846 / 0.871:
  step 1000 (256k rows)  0.851 / 0.802 / 0.826   88% of the gap (mid-schedule)
  step 2000 (512k rows)  0.869 / 0.820 / 0.845   93% (93% click, 93% conversion)
With --config.seed=1 (other init and row order): 0.865 / 0.816 / 0.840, 92%.

How it was found (in-process sweep, one device, 128k rows, the same 20k eval
rows; mean gap closed): the previous config (batch 1024, two blocks, 'hash',
table lr 0.3) 81.2%; alone, dense lr 1e-2 80.7%, table lr 1.0 81.8%, 'silu'
attention 81.7%, one block 81.6%, table dim 32 82.1%, 'mmoe' heads 81.9%;
batch 256 (4x the steps) 83.0% (two blocks) / 82.7% (one); then with
id_policy 'error' 85.2%, plus table lr 1.0 86.1% (batch 128 instead:
86.0%). One block learns as fast per row as two and its step is 1.8x
cheaper (2 x 4 mesh, batch 1024, load ~12: 1.25 vs 2.24 s). The slowest
parts to learn are the sequence matches and the pairwise interactions:
regressing the model's click logit on the planted terms gives coefficients
0.26 (sequence) and 0.34 (pairs) against 0.74 (per-value effects) after 128k
rows, 0.47 / 0.76 / 0.85 after 512k.

Data: synthetic 'small' (8 pooled features incl. a 4-id bag, 2 event streams of
32 and 64 events, 3 domains, click + conversion). Model: GEM 'small' preset
with one block. Sizes: 207k dense parameters, 100k embedding parameters (8
tables, dim 16); 3.2 MFLOPs forward, 9.5 MFLOPs training FLOPs per example
(analytic, gem_jax.flops; sequences at padded length).
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
  c.data.batch_size = 256
  c.data.eval_batch_size = 1024
  c.data.eval_examples = 20_000
  c.data.shuffle_buffer = 0
  c.data.bad_row_limit = 0.01

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"
  c.model.preset = "small"
  c.model.overrides = ml_collections.ConfigDict()
  c.model.overrides.num_blocks = 1
  c.model.dtype = "float32"
  c.model.fp8 = False
  c.model.remat = "none"

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 16
  c.embedding.optimizer = "rowwise_adagrad"
  c.embedding.lr = 1.0
  c.embedding.warmup_steps = 0
  c.embedding.sharding = "auto"
  c.embedding.id_policy = "error"
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
  c.train.steps = 2000
  c.train.log_every = 100
  c.train.eval_every = 1000
  c.train.eval_batches = 0
  c.train.checkpoint_every = 1000
  c.train.keep = 2
  c.train.best_metric = "eval_auc"
  c.train.grad_accum = 1
  c.train.profile_steps = ""
  c.train.compile_cache = ""
  return c
