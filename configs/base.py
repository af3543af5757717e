"""base: the config schema. Every field a run reads, with its default and meaning.

The run configs beside this file start from `get_config()` (trainer runs:
scripts/train.py, scripts/evaluate.py, scripts/benchmark.py) or
`student_config()` (knowledge-transfer students: gem_jax.transfer.train) and set
only what differs. A field missing here does not exist: with the locked configs
of the entry scripts, `--config.train.stepz=1` is an error, and
tests/test_configs.py fails when a run config adds a field of its own. The one
open block is `model.overrides`: fields of the model's config (gem_jax.models),
checked when the model is built (`--config.model.overrides.FIELD=VALUE` sets any of them).

How long a run trains (gem_jax.train.setup.resolve_steps, one rule):
`train.steps > 0` is the number of steps, whatever `train.epochs` says; with
`train.steps = 0` the run makes `train.epochs` passes over `data.train`,
ceil(epochs * rows / data.batch_size) steps, rows being what the train source
reports (file sources: the files' line count, bad and blank lines included;
generated ones: `data.train_examples`). The dataset configs (criteo, avazu,
adult, alimama, movielens) set steps = 0, epochs = 1, so `--config.train.steps=N`
still sets their length. `train.early_stop_patience = N > 0` ends the run (with a
checkpoint) after N evaluations in a row that do not improve on the best
`train.best_metric` so far; the run's summary reports the best evaluation next
to the last.

Run configs import this module by its path, which works however they are loaded
(absl `config_flags`, gem_jax.bench.runner.load_config, importlib in tests):

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import base
"""
import os

import ml_collections
from ml_collections import config_dict

# Shared data samples: $GEM_JAX_DATA, else ../shared/data beside the checkout.
DATA = os.environ.get("GEM_JAX_DATA", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "..", "..", "shared", "data"))


def get_config() -> ml_collections.ConfigDict:
  """The trainer schema (gem_jax.train.loop): seed, mesh, data, model, embedding, optim, train."""
  c = ml_collections.ConfigDict()
  c.seed = 0                          # parameter init, dropout and data order
  c.mesh = (1, -1)                    # (replica, shard) device mesh; -1: the remaining devices

  c.data = ml_collections.ConfigDict()
  c.data.kind = "synthetic"           # source (gem_jax.data.registry): synthetic, criteo, ...
  c.data.format = "auto"              # 'text' | 'parquet' (scripts/preprocess.py output) |
                                      # 'auto': parquet where data.train/eval is such a dataset
  c.data.train = ""                   # file sources: train files (path, comma list or glob)
  c.data.eval = ""                    # file sources: eval files
  c.data.batch_size = 256             # global train batch (all devices, all processes)
  c.data.eval_batch_size = 256        # global eval batch
  c.data.eval_examples = 0            # eval rows; 0: the whole eval file (generated data: set it)
  c.data.shuffle_buffer = 0           # file sources: block-shuffle size in rows (<= 1: file order)
  c.data.lanes = 16                   # parquet: row streams per batch (batch % lanes == 0,
                                      # lanes % process count == 0; fixes the batch order)
  c.data.reader_workers = 2           # parquet: threads reading row groups ahead
  c.data.bad_row_limit = 0.01         # file sources: bad-row fraction that stops the run
  c.data.vocab_size = 1 << 20         # file sources: table rows (hash buckets) per id feature
  c.data.int_buckets = False          # criteo: also embed the bucketised integer features
  c.data.movies = ""                  # movielens: movies.csv (genres); '' = none
  c.data.split_quantile = 0.8         # movielens: train/eval time split at this ratings quantile
  c.data.split_timestamp = 0          # movielens: > 0: split at this unix time instead
  c.data.max_len = 50                 # movielens: history events kept (most recent);
                                      # long_history: the longest history (its L)
  c.data.max_genres = 10              # movielens: genres kept per movie
  c.data.like_threshold = 4.0         # movielens: label 1 when rating >= this
  c.data.preset = "tiny"              # synthetic: feature preset (gem_jax.data.synthetic)
  c.data.seed = 0                     # synthetic, transfer_planted, long_history: data seed
  c.data.train_examples = config_dict.placeholder(int)  # generated: train rows (None/0: endless)
  c.data.role = "teacher"             # transfer_planted: 'teacher' (old labels) or 'student'
  c.data.num_tables = 8               # torchrec_synthetic: tables (one feature each)
  c.data.rows = 100_000               # torchrec_synthetic: rows per table
  c.data.pooling = 1                  # torchrec_synthetic: ids per table per example
  c.data.alpha = 1.05                 # torchrec_synthetic: Zipf exponent of the ids
  c.data.peer_seed = 0                # torchrec_synthetic: the peer's --seed
  c.data.pool = 32                    # torchrec_synthetic: distinct batches, cycled
  # long_history (gem_jax/data/long_history.py): n ~ LogNormal(log median, sigma) events,
  # clipped to [1, max_len], 0 with p_empty; uniform items of `vocab`; the candidate is a
  # deep event's item (older than the `recent` newest) with p_deep, a recent one's with
  # p_recent; click logit bias + beta * 1[candidate in history]; gaps ~ Exp(mean_gap_s)
  c.data.median = 300.0               # long_history: median history length
  c.data.sigma = 1.0                  # long_history: log-normal sigma of the lengths
  c.data.p_empty = 0.02               # long_history: share of users with no history
  c.data.vocab = 100_000              # long_history: items (candidate and history share them)
  c.data.recent = 64                  # long_history: the newest events a short model sees
  c.data.p_deep = 0.35                # long_history: candidate from a deep event
  c.data.p_recent = 0.15              # long_history: candidate from a recent event
  c.data.beta = 3.0                   # long_history: logit of a match
  c.data.bias = -1.5                  # long_history: logit without one
  c.data.mean_gap_s = 3600.0          # long_history: mean seconds between events

  c.model = ml_collections.ConfigDict()
  c.model.name = "gem"                # gem | dlrm | dcnv2 | lr | fm | fwfm (gem_jax.train.loop)
  c.model.preset = "small"            # size preset of that model (gem_jax.models)
  c.model.overrides = ml_collections.ConfigDict()  # model-config fields replacing the preset's
  c.model.dtype = "float32"           # compute dtype (parameters stay fp32): float32 | bfloat16
  c.model.fp8 = False                 # fp8 matmuls of the large layers (overrides the preset)
  c.model.remat = "none"              # rematerialisation: none | dots | full (overrides the preset)

  c.embedding = ml_collections.ConfigDict()
  c.embedding.dim = 16                # embedding width of every table
  c.embedding.optimizer = "rowwise_adagrad"  # table optimizer: rowwise_adagrad | adam | sgd
  c.embedding.lr = ml_collections.config_dict.placeholder(float)  # table learning rate; unset:
                                      # the model's own for rowwise_adagrad (train/setup.py MODELS)
  c.embedding.initial_accumulator = 0.0  # rowwise_adagrad: every row's starting sum of g^2
                                      # (TF's Adagrad: 0.1; FBGEMM: 0); > 0 damps rare rows' steps
  c.embedding.warmup_steps = 0        # linear warm-up of the table learning rate
  c.embedding.sharding = "auto"       # auto | table_wise | row_wise | column_wise | replicated
  c.embedding.id_policy = "hash"      # raw ids -> rows: hash | clip | error (ids are rows)
  c.embedding.memory_budget_gb = 4.0  # per-device table memory the plan may use
  c.embedding.replica_sync = "auto"   # gradients across replicas: rows | dense | auto (fewer bytes)
  c.embedding.rw_exchange = "auto"    # row-wise ids to owners: auto (ragged on GPU/TPU, a2a on
                                      # CPU) | ragged | a2a (padded) | broadcast
  c.embedding.per_table = ""          # per-table dim/dtype/optimizer/lr, e.g. 'C1|C2: dim=64,
                                      # optimizer=adam, lr=1e-3; hist_*: dtype=bfloat16'
                                      # (gem_jax.train.setup.per_table_settings)
  c.embedding.id_stats_batches = 4    # train batches sampled for the planner's id statistics
                                      # (row-wise all_to_all capacity); 0: assume all distinct
  c.embedding.share_tables = True     # features that share a vocabulary read one table

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"              # dense optimizer: adamw | sgd | adagrad
  c.optim.lr = 1e-3                   # dense peak learning rate
  c.optim.warmup_steps = 20           # linear warm-up steps
  c.optim.decay = "cosine"            # after warm-up: cosine | constant
  c.optim.weight_decay = 0.0          # decoupled weight decay
  c.optim.clip_norm = 1.0             # global gradient-norm clip; 0: none

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000                # train steps; 0: train.epochs passes (see the module doc)
  c.train.epochs = 0.0                # with steps = 0: passes over data.train (may be fractional)
  c.train.log_every = 25              # steps between logged (and written) train metrics
  c.train.eval_every = 100            # steps between evaluations; 0: only at the end
  c.train.eval_batches = 0            # batches per evaluation; 0: a full pass over data.eval
  c.train.checkpoint_every = 100      # steps between checkpoints; 0: only at the end
  c.train.keep = 2                    # recent checkpoints kept (plus the best)
  c.train.best_metric = "eval_auc"    # eval metric whose best checkpoint is kept (auc: max,
                                      # logloss/ne: min); early stopping watches it too
  c.train.early_stop_patience = 0     # > 0: stop after this many evals without a new best
  c.train.grad_accum = 1              # micro-batches per step (must divide the per-device batch)
  c.train.grad_reduce_dtype = "float32"  # dense weight gradients' cross-device reductions:
                                      # float32 | bfloat16 (half the bytes; model.dtype bfloat16)
  c.train.profile_steps = ""          # 'A,B': trace steps [A, B) into the workdir; '' off
  c.train.compile_cache = ""          # XLA cache dir; '' = $GEM_JAX_COMPILE_CACHE or ~/.cache
  c.train.stop_at = 0                 # > 0: stop (and checkpoint) here: a simulated preemption
  c.train.id_collision_metrics = True  # log id-policy collisions per step (hashed tables)
  c.train.nonfinite = "skip"          # non-finite loss or gradient: skip | rollback | stop
  c.train.max_rollbacks = 3           # with 'rollback': give up after this many
  c.train.preempt_check_every = 1     # steps between collective preemption checks (multi-host)
  c.train.inject_nan_step = 0         # debug: NaN dense features at this step; 0: off
  c.train.save_failures = 3           # failed checkpoint saves in a row survived (disk full,
                                      # read-only, ...); one more stops the run
  c.train.save_when_busy = "wait"     # a save due while the last is still writing: wait | skip
  return c


def student_config() -> ml_collections.ConfigDict:
  """The student schema (gem_jax.transfer.train): the trainer's data, embedding and optim
  blocks; its own model and train blocks; knowledge, teacher and transfer."""
  c = get_config()
  c.embedding.lr = 0.05               # the student's table learning rate (row-wise Adagrad)
  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny"             # GEM preset of the Student's front end
  c.model.dtype = "float32"           # compute dtype
  c.model.overrides = ml_collections.ConfigDict()  # model-config fields replacing the preset's

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000                # train steps
  c.train.log_every = 0               # steps between logged train metrics; 0: none
  c.train.grad_accum = 1              # micro-batches per step (exact: the same gradient)

  c.knowledge = ml_collections.ConfigDict()
  c.knowledge.train = ""              # knowledge of data.train (generate_knowledge.py --out)
  c.knowledge.eval = ""               # knowledge of data.eval

  c.teacher = ml_collections.ConfigDict()
  c.teacher.config = ""               # the teacher's config file (parameter sharing restores it)
  c.teacher.workdir = ""              # the teacher's workdir (its latest checkpoint)

  c.transfer = ml_collections.ConfigDict()
  c.transfer.distill_weights = ()     # distillation weight per task; () = no distillation
  c.transfer.temperature = 1.0        # distillation temperature
  c.transfer.adapter = False          # distil from the Student Adapter's corrected logits
  c.transfer.adapter_hidden = (16,)   # the adapter's MLP
  c.transfer.teacher_emb = ""         # representation transfer from this knowledge field; '' off
  c.transfer.share_tables = ()        # parameter sharing: teacher tables the student reuses
  c.transfer.share_blocks = ()        # parameter sharing: teacher blocks (e.g. 'dense_tok')
  c.transfer.freeze_shared = False    # keep the shared parameters frozen
  c.transfer.train_student = True     # False: adapter-only training
  return c
