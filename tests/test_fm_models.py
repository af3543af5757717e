"""FM and FwFM (gem_jax.models.fm) against a float64 NumPy double loop over field pairs;
FM with its pair scale at 0 is LinearModel; both learn a pure pairwise signal LR cannot;
both build and take a jitted train step through the trainer's model registry."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gem_jax.bench import runner
from gem_jax.data.spec import DataSpec, SequenceStreamSpec, SparseFeatureSpec
from gem_jax.data.synthetic import rank_auc
from gem_jax.models import get_config, random_inputs
from gem_jax.models.fm import FM, FwFM, fm_flops, fwfm_flops
from gem_jax.models.linear import LinearModel, linear_flops
from gem_jax.train import setup
from gem_jax.train import step as step_lib

B, D = 6, 4
SPEC = DataSpec(
    n_dense=3,
    sparse=(SparseFeatureSpec("f0", 50), SparseFeatureSpec("f1", 50, bag=3),
            SparseFeatureSpec("hist", 50)),
    sequences=(SequenceStreamSpec("s", max_len=5, item_features=("hist",)),),
    num_domains=2, tasks=("click", "conversion"))
FD = {"f0": D, "f1": D, "hist": D}
F = 3
CFG = get_config("tiny")


@pytest.fixture(scope="module")
def inputs():
  x = random_inputs(SPEC, FD, B, seed=3, lengths={"s": np.array([0, 1, 5, 3, 2, 5])})
  x["domain"] = np.array([0, 1, 1, 0, 1, 0], np.int32)
  return x


def _randomized(cls):
  """A model with non-default biases and pair weights (so every lookup is tested)."""
  m = cls(CFG, SPEC, FD, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  m.domain_bias[...] = jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)
  if cls is FM:
    m.pair_scale[...] = jnp.asarray([0.7, -1.3], jnp.float32)
  else:
    m.pair_weight[...] = jnp.asarray(rng.normal(size=(F * (F - 1) // 2, 2)), jnp.float32)
  return m


def np_fields(x):
  """[f0, f1, masked mean of hist] (float64, each (B, D)) and x = [dense; fields]."""
  seq = x["seq"]["s"]
  mean = np.zeros((B, D))
  for b in range(B):
    n = int(seq["mask"][b].sum())
    if n:
      mean[b] = seq["items"]["hist"][b, :n].astype(np.float64).mean(0)
  fields = [x["sparse"]["f0"].astype(np.float64), x["sparse"]["f1"].astype(np.float64), mean]
  return fields, np.concatenate([x["dense"].astype(np.float64)] + fields, 1)


def np_forward(m, x):
  """x W + b_dom[domain] + (FM) s_t sum_{i<j} <e_i, e_j> | (FwFM) sum_{i<j} r_ij,t <e_i, e_j>."""
  fields, feats = np_fields(x)
  w = np.asarray(m.linear.kernel[...], np.float64)
  bias = np.asarray(m.domain_bias[...], np.float64)
  out = feats @ w + bias[x["domain"]]  # (B, T)
  p = 0
  for i in range(F):
    for j in range(i + 1, F):
      dot = np.sum(fields[i] * fields[j], axis=1)  # (B,)
      if isinstance(m, FwFM):
        out += dot[:, None] * np.asarray(m.pair_weight[...], np.float64)[p][None, :]
      else:
        out += dot[:, None] * np.asarray(m.pair_scale[...], np.float64)[None, :]
      p += 1
  return out


@pytest.mark.parametrize("cls", [FM, FwFM])
def test_matches_numpy_double_loop(cls, inputs):
  m = _randomized(cls)
  y, aux = m(inputs, return_aux=True)
  assert y.shape == (B, 2) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), np_forward(m, inputs), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(aux["trunk"]), np_fields(inputs)[1], rtol=1e-6,
                             atol=1e-6)
  assert aux["interaction"].shape == ((B,) if cls is FM else (B, 3))


@pytest.mark.parametrize("cls", [FM, FwFM])
def test_padded_events_are_ignored(cls, inputs):
  m = _randomized(cls)
  x = jax.tree.map(np.copy, inputs)
  x["seq"]["s"]["items"]["hist"][~x["seq"]["s"]["mask"]] = 1e3
  np.testing.assert_array_equal(np.asarray(m(x)), np.asarray(m(inputs)))


def test_fm_pair_weights_init():
  fm, fwfm = FM(CFG, SPEC, FD, rngs=nnx.Rngs(0)), FwFM(CFG, SPEC, FD, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(fm.pair_scale[...]), np.ones(2))
  np.testing.assert_allclose(np.asarray(fwfm.pair_weight[...]), np.full((3, 2), 1 / 3))
  assert fwfm.triu == ((0, 0, 1), (1, 2, 2))


@pytest.mark.parametrize("cls", [FM, FwFM])
def test_zero_pair_weights_is_the_linear_model(cls, inputs):
  lr = LinearModel(CFG, SPEC, FD, rngs=nnx.Rngs(7))
  lr.domain_bias[...] = jnp.asarray(np.random.default_rng(2).normal(size=(2, 2)), jnp.float32)
  m = _randomized(cls)
  m.linear.kernel[...] = lr.linear.kernel[...]
  m.domain_bias[...] = lr.domain_bias[...]
  if cls is FM:
    m.pair_scale[...] = jnp.zeros((2,), jnp.float32)
  else:
    m.pair_weight[...] = jnp.zeros((3, 2), jnp.float32)
  np.testing.assert_array_equal(np.asarray(m(inputs)), np.asarray(lr(inputs)))
  assert not np.allclose(np.asarray(_randomized(cls)(inputs)), np.asarray(lr(inputs)))


def test_one_width_for_all_fields():
  with pytest.raises(ValueError, match=r"FM: .*one embedding width.*'f1': 6"):
    FM(CFG, SPEC, {**FD, "f1": 6}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"FwFM: .*one embedding width.*'hist': 8"):
    FwFM(CFG, SPEC, {**FD, "hist": 8}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="at least 2 fields"):
    FM(CFG, DataSpec(n_dense=1, sparse=(SparseFeatureSpec("a", 5),)), {"a": D},
       rngs=nnx.Rngs(0))


def test_flops():
  k = 3 + 3 * D
  assert linear_flops(SPEC, FD) == 2 * k * 2
  assert fm_flops(SPEC, FD) == 2 * k * 2 + 3 * F * D + 2 * D + 2
  assert fwfm_flops(SPEC, FD) == 2 * k * 2 + 2 * F * F * D + 2 * 3 * 2


# ---------------------------------------------------------------- learning --

V, K_HIDDEN, DIM = 16, 2, 8
LSPEC = DataSpec(n_dense=1, sparse=tuple(SparseFeatureSpec(n, V) for n in ("a", "b", "c")),
                 num_domains=1, tasks=("click",))
LFD = {n: DIM for n in ("a", "b", "c")}


def _planted(n, seed):
  """Label logit 4 <u_a, u_b> (centred hidden factors: no first-order effect); c, dense noise."""
  rng = np.random.default_rng(0)
  u = rng.normal(size=(2, V, K_HIDDEN))
  u -= u.mean(axis=1, keepdims=True)  # every value's mean effect over the other field is 0
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, size=(n, 3))
  logit = 4.0 * np.sum(u[0][ids[:, 0]] * u[1][ids[:, 1]], axis=1)
  labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
  return ids, rng.normal(size=(n, 1)).astype(np.float32), labels


class WithTables(nnx.Module):
  """A model plus plain nnx.Param embedding tables (no sharded engine): ids -> logits."""

  def __init__(self, cls, *, rngs):
    self.tables = nnx.Param(0.1 * jax.random.normal(rngs.params(), (3, V, DIM)))  # (F, V, D)
    self.model = cls(CFG, LSPEC, LFD, rngs=rngs)

  def __call__(self, ids, dense):
    sparse = {n: self.tables[...][i][ids[:, i]] for i, n in enumerate(("a", "b", "c"))}
    inputs = {"dense": dense, "sparse": sparse, "seq": {},
              "domain": jnp.zeros((ids.shape[0],), jnp.int32)}
    return self.model(inputs)[:, 0]


def _trained_auc(cls, steps=300):
  ids, dense, labels = _planted(4096, seed=1)
  t_ids, t_dense, t_labels = _planted(4096, seed=2)
  graphdef, params = nnx.split(WithTables(cls, rngs=nnx.Rngs(0)))
  tx = optax.adam(3e-2)

  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(ids, dense)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))

  @jax.jit
  def train(p):
    def body(carry, _):
      p, o = carry
      g = jax.grad(loss_fn)(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), None
    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), None, length=steps)
    return p

  params = train(params)
  scores = jax.jit(lambda p: nnx.merge(graphdef, p)(t_ids, t_dense))(params)
  return rank_auc(np.asarray(scores), t_labels)


def test_fm_and_fwfm_learn_a_pairwise_signal_lr_cannot():
  lr_auc = _trained_auc(LinearModel)
  fm_auc, fwfm_auc = _trained_auc(FM), _trained_auc(FwFM)
  assert lr_auc < 0.6, lr_auc
  assert fm_auc > lr_auc + 0.1 and fwfm_auc > lr_auc + 0.1, (lr_auc, fm_auc, fwfm_auc)


# ----------------------------------------------------------------- trainer --

@pytest.mark.parametrize("name", ["fm", "fwfm"])
def test_trainer_builds_and_steps(name):
  c = runner.load_config("tiny")
  c.model.name = name
  s = setup.setup(c)
  model = s.model_fn(nnx.Rngs(0))
  assert type(model) is {"fm": FM, "fwfm": FwFM}[name]
  state = setup.init_state(s, 0)
  batch = runner.device_batches(s, c, 1)[0]
  fn = step_lib.jit_train_step(s.step_cfg, s.shardings, jax.tree.map(lambda a: a.sharding, batch))
  state, m = fn(state, batch)
  assert np.isfinite(float(m["train_loss"])) and int(state.step) == 1
  got = setup.train_flops_per_example(c.model, s.spec, s.feature_dims)
  fwd = {"fm": fm_flops, "fwfm": fwfm_flops}[name](s.spec, s.feature_dims)
  assert got == 3 * fwd > 0
