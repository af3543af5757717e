"""The knowledge-transfer student step is the trainer's step with the student's loss and
masks: equal to it bit for bit with zero transfer weights and nothing frozen, grad_accum
equals the full batch, the non-finite guard skips a poisoned student step, frozen parts
stay bit-identical, and the student's eval is the trainer's eval step (activation pinning
included). A tiny MLP student: compiles in about a second."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import compile_with_xla_defaults, make_mesh
from gem_jax.layers.adapter import StudentAdapter
from gem_jax.parallel import sharding
from gem_jax.train import evaluate, nonfinite
from gem_jax.train import state as state_lib
from gem_jax.train import step as step_lib
from gem_jax.transfer import step as tstep
from gem_jax.transfer.student import TransferOptions, frozen_row_ranges, trainable_mask
from test_step_fixtures import DIM, SPEC, Built, TinyModel, make_batch

STEPS = 3


class TinyBundle(nnx.Module):
  """StudentBundle's shape: {student, adapter}; calling it runs the student."""

  def __init__(self, adapter: bool, *, rngs):
    self.student = TinyModel(SPEC, {f.name: DIM for f in SPEC.sparse}, rngs=rngs)
    self.adapter = StudentAdapter(2, 3, 2, hidden=(4,), rngs=rngs) if adapter else None

  def __call__(self, x):
    return self.student(x)


class Student:
  """A Built (plan, optimizer, putter) around TinyBundle, with its StudentStepConfig."""

  def __init__(self, mesh, opts, grad_accum=1, trainable=None, frozen_tables=()):
    b = self.b = Built(mesh, grad_accum=grad_accum)
    self.model_fn = lambda rngs: TinyBundle(opts.adapter, rngs=rngs)
    self.abstract, self.shardings = state_lib.abstract_train_state(
        self.model_fn, b.tx, b.plan, b.emb_init, b.acc_fn, mesh)
    mask = trainable_mask(self.abstract.params, opts) if trainable is None else trainable(
        self.abstract.params)
    self.cfg = tstep.StudentStepConfig(
        state_lib.model_graphdef(self.model_fn), b.plan, b.tx, b.cfg.schedule, b.cfg.sparse_lr,
        SPEC, opts, mask, frozen_row_ranges(b.plan, frozen_tables), grad_accum)

  def init(self, seed=0):
    return state_lib.init_train_state(jax.random.key(seed), self.model_fn, self.b.tx,
                                      self.b.emb_init, self.b.acc_fn, self.shardings)

  def batches(self, n=STEPS, poison=None):
    out = []
    for i in range(n):
      raw = make_batch(i)
      rng = np.random.default_rng(100 + i)
      valid = (rng.random(16) < 0.75).astype(np.float32)  # padding rows of the knowledge
      raw["teacher"] = {"logits": rng.normal(size=(16, 2)).astype(np.float32), "valid": valid}
      if poison == i:
        raw["teacher"]["logits"][3, 1] = np.nan
      out.append(self.b.put(raw))
    return out

  def sh(self, batch):
    return jax.tree.map(lambda x: x.sharding, batch)

  def train_fn(self, batch):
    return tstep.jit_student_train_step(self.cfg, self.shardings, self.sh(batch))


def _host(tree):
  """Host copies (np.array copies: on CPU a view would follow the donated buffers)."""
  return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


def _equal(a, b):
  la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _run(fn, state, batches):
  ms = []
  for batch in batches:
    state, m = fn(state, batch)
    ms.append(_host(m))
  return state, ms


@pytest.mark.parametrize("weights", [None, (0.0, 0.0)], ids=["no-distill", "zero-weights"])
def test_student_step_equals_trainer_step(weights):
  st = Student(make_mesh(2, 2), TransferOptions(distill_weights=weights))
  batches = st.batches()
  # two different programs compared bit for bit: both with XLA's default code generation
  state = st.init()
  student = compile_with_xla_defaults(st.train_fn(batches[0]), state, batches[0])
  got, gm = _run(student, state, batches)
  state = st.init()
  trainer = compile_with_xla_defaults(step_lib.jit_train_step(
      st.cfg.step_cfg, st.shardings, st.sh(batches[0]), skip_nonfinite=True), state, batches[0])
  want, wm = _run(trainer, state, batches)
  assert _equal(got, want)  # params, optimizer, tables, step, RNG: bit for bit
  for g, w in zip(gm, wm):
    assert set(g) == set(w) | {"loss_hard", "loss_soft", "loss_adapt"}
    for k in w:
      assert np.array_equal(g[k], w[k]), k
    assert g["loss_soft"] == 0.0 and g["loss_hard"] == g["train_loss"]
  assert int(got.step) == STEPS


def test_student_grad_accumulation_equals_full_batch():
  """Every term has its own micro-batch weight: hard/adapt by labels, soft by valid rows."""
  opts = TransferOptions(distill_weights=(1.0, 0.5), temperature=2.0, adapter=True)
  ref = Student(make_mesh(1, 1), opts)
  acc = Student(make_mesh(1, 2), opts, grad_accum=4)
  rb, ab = ref.batches(), acc.batches()
  want, wm = _run(ref.train_fn(rb[0]), ref.init(), rb)
  got, gm = _run(acc.train_fn(ab[0]), acc.init(), ab)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
  for k in ("train_loss", "loss_hard", "loss_soft", "loss_adapt", "grad_norm"):
    close([m[k] for m in gm], [m[k] for m in wm])
  assert all(m["loss_soft"] > 0 and m["loss_adapt"] > 0 for m in gm)
  jax.tree.map(close, _host(got.params), _host(want.params))
  from gem_jax.embedding import export_state
  jax.tree.map(close, _host(export_state(acc.b.plan, got.emb)),
               _host(export_state(ref.b.plan, want.emb)))


def test_nonfinite_guard_skips_a_poisoned_student_step():
  st = Student(make_mesh(2, 2), TransferOptions(distill_weights=(1.0, 1.0)))
  batches = st.batches(2, poison=0)  # NaN teacher logit: only the soft term sees it
  fn = st.train_fn(batches[0])
  state = st.init()
  before = _host(state)
  state, m = fn(state, batches[0])
  after = _host(state)
  assert float(m["nonfinite_loss"]) == 1.0 and float(m["train_loss"]) == 0.0
  assert float(m["loss_soft"]) == 0.0 and np.isfinite(float(m["loss_hard"]))
  for name in ("params", "opt_state", "emb", "model_state"):
    assert _equal(getattr(after, name), getattr(before, name)), name
  assert int(after.step) == 1 and not np.array_equal(after.rng, before.rng)
  state, m = fn(state, batches[1])
  assert float(m["nonfinite_loss"]) == 0.0 and float(m["loss_soft"]) > 0
  assert not _equal(_host(state).emb, before.emb)


def test_skip_counter_is_found_by_type_not_chain_position():
  import optax
  b = Built(make_mesh(1, 1))
  tx = optax.chain(nonfinite.with_skip_counter(b.tx), optax.scale(1.0))  # counter not last
  state = b.init().replace(opt_state=tx.init(b.init().params))
  opt = nonfinite.count_skipped(state.opt_state, jnp.bool_(True))
  assert nonfinite.skipped_steps(state.replace(opt_state=opt)) == 1
  assert jax.tree.structure(opt) == jax.tree.structure(state.opt_state)
  back = nonfinite.rolled_back(state.replace(opt_state=opt, step=jnp.int32(7)), state)
  assert nonfinite.skipped_steps(back) == 1 and int(back.step) == 7
  with pytest.raises(ValueError, match="SkipCountState"):
    nonfinite.skipped_steps(b.init())


def test_frozen_blocks_and_tables_stay_and_adapter_only_trains_the_adapter():
  frozen_l1 = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: "l1" not in jax.tree_util.keystr(path), params)
  st = Student(make_mesh(2, 2), TransferOptions(distill_weights=(1.0, 1.0)),
               trainable=frozen_l1, frozen_tables=("user",))
  batches = st.batches()
  s0 = st.init()
  p0 = _host(s0.params)
  from gem_jax.embedding import export_state
  e0 = _host(export_state(st.b.plan, s0.emb))
  s1, _ = _run(st.train_fn(batches[0]), s0, batches)
  p1, e1 = _host(s1.params), _host(export_state(st.b.plan, s1.emb))
  assert _equal(p1["student"]["l1"], p0["student"]["l1"])
  assert not _equal(p1["student"]["l2"], p0["student"]["l2"])
  assert _equal(e1["user"], e0["user"]) and not _equal(e1["ad"], e0["ad"])

  ad = Student(make_mesh(2, 2), TransferOptions(distill_weights=(1.0, 1.0), adapter=True,
                                                train_student=False))
  s0 = ad.init()
  p0, e0 = _host(s0.params), _host(s0.emb)
  s1, m = _run(ad.train_fn(batches[0]), s0, ad.batches())
  assert _equal(s1.params["student"], p0["student"]) and _equal(s1.emb, e0)
  assert not _equal(s1.params["adapter"], p0["adapter"]) and m[-1]["loss_adapt"] > 0


def test_student_eval_is_the_trainers_eval_step(monkeypatch):
  st = Student(make_mesh(2, 2), TransferOptions(distill_weights=(1.0, 1.0)))
  batch = st.batches(1)[0]
  pinned = []
  real = sharding.activation_sharding

  @contextlib.contextmanager
  def spy(mesh):
    pinned.append(mesh)
    with real(mesh):
      yield
  monkeypatch.setattr(sharding, "activation_sharding", spy)
  state = st.init()
  got = tstep.jit_student_eval_step(st.cfg, st.shardings, st.sh(batch))(state, batch)
  assert pinned == [st.b.plan.mesh]  # traced once, with the activations pinned
  want = evaluate.jit_eval_step(st.cfg.step_cfg, st.shardings, st.sh(batch))(state, batch)
  assert _equal(got, want)  # the student's logits are the bundle's here
  assert any(np.any(x) for x in jax.tree.leaves(_host(got)))


def test_student_config_grad_accum_must_divide_the_per_device_batch():
  """configs/base.py's student schema declares train.grad_accum; train_student checks it
  before reading any data (student_planted: batch 128)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  from gem_jax.train import validate  # pylint: disable=import-outside-toplevel
  from gem_jax.transfer import train as ttrain  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "student_planted.py")
  spec = importlib.util.spec_from_file_location("student_planted_cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  per_device = c.data.batch_size // jax.device_count()
  c.train.grad_accum = per_device + 1
  with pytest.raises(validate.ConfigError, match=rf"grad_accum={per_device + 1} must divide"):
    ttrain.train_student(c)
