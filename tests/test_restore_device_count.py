"""A full train state written on 8 devices, restored onto 4 and onto 1 device.

Through the real entry script (scripts/train.py, configs/tiny.py) with the
'dlrm' model (FSDP-sharded dense kernels, row- and column-sharded tables, AdamW
+ row-wise Adagrad slots; it compiles in seconds), and, marked slow, the tiny
GEM itself (a minute to compile per process):

  reference  8 devices, mesh 2x4, steps 1..6 uninterrupted, checkpoints at 3 and 6;
  resumed    a fresh workdir holding only the step-3 checkpoint, continued to
             step 6 in a process with another device count:
               4 devices, mesh 2x2;
               1 device,  mesh 1x1;
               4 devices, mesh 1x4 with grad_accum=2: a different batch split
               (the global batch stays 64 examples; each device holds 16 rows,
               run as 2 micro-batches of 8, against 8 rows in one piece on 2x4).

Each resumed run must log the reference's losses for steps 4..6 (so it resumed
the data position too: the synthetic stream is not periodic) and write, at step
6, the reference's full state: every leaf (step, dense params, optimizer state,
tables and their slots, RNG, metric accumulators) read back on the host from
the step-6 checkpoints, to atol=1e-6 and rtol=1e-6. Integers are exact.
Run with -s for the measured max differences per leaf group.

Checked by hand that it can fail: a resumed run whose checkpoint has no data
position (it restarts the stream) fails on the losses; one whose restore drops
the RNG leaf logs the same losses (the step draws nothing) and fails on the state.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from saved_state import saved_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, RESTORE_AT = 6, 3
ATOL = RTOL = 1e-6
COMMON = (f"--config.train.steps={STEPS}",
          f"--config.train.checkpoint_every={RESTORE_AT}", "--config.train.eval_every=3",
          "--config.train.keep=3")
CASES = {  # name: (device count, mesh, extra overrides)
    "4dev_2x2": (4, (2, 2), ()),
    "1dev_1x1": (1, (1, 1), ()),
    "4dev_1x4_accum2": (4, (1, 4), ("--config.train.grad_accum=2",)),
}


def _train(workdir, model, devices, mesh, *overrides):
  """scripts/train.py in a process with `devices` CPU devices; returns its stderr."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
         os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(workdir), *COMMON,
         f"--config.model.name={model}",
         f"--config.mesh=({mesh[0]},{mesh[1]})", *overrides]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr


def _log(workdir):
  """{step: metrics row} of the training steps in metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if "train_loss" in r}


def _saved_data(workdir, step):
  """The `data` item (data iterator positions) of checkpoint `step`."""
  path = os.path.join(workdir, "checkpoints", str(step), "data")
  return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path)["data"]


@pytest.fixture(scope="module", params=["dlrm", pytest.param("gem", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory):
  """The reference run and the three resumed ones, for one model."""
  tmp = tmp_path_factory.mktemp(f"devcount_{request.param}")
  ref = tmp / "ref"
  logs = {"ref": _train(ref, request.param, 8, (2, 4))}
  assert "mesh {'replica': 2, 'shard': 4} on 8 cpu devices" in logs["ref"]
  for name, (devices, mesh, extra) in CASES.items():
    shutil.copytree(ref / "checkpoints" / str(RESTORE_AT),
                    tmp / name / "checkpoints" / str(RESTORE_AT))
    logs[name] = _train(tmp / name, request.param, devices, mesh, *extra)
  return tmp, logs, request.param


def _group(key):
  """Leaf group for the report: step, params, opt_state, emb weight / slots, rng, metrics."""
  top = key.split("]")[0].strip("['")
  if top == "emb":
    return "emb.weight" if key.endswith("['weight']") else "emb.slots"
  return top


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_on_other_device_count(runs, case):
  tmp, logs, model = runs
  devices, mesh, _ = CASES[case]
  assert f"mesh {{'replica': {mesh[0]}, 'shard': {mesh[1]}}} on {devices} cpu devices" \
      in logs[case], logs[case][-2000:]
  assert f"resumed from the checkpoint at step {RESTORE_AT}" in logs[case]
  ref, got = _log(tmp / "ref"), _log(tmp / case)
  assert sorted(ref) == list(range(1, STEPS + 1))
  assert sorted(got) == list(range(RESTORE_AT + 1, STEPS + 1))  # no step retrained
  loss_diff = max(abs(got[s]["train_loss"] - ref[s]["train_loss"]) for s in got)
  for key in ("train_loss", "grad_norm", "labels_observed"):
    np.testing.assert_allclose([got[s][key] for s in sorted(got)],
                               [ref[s][key] for s in sorted(got)], rtol=RTOL, atol=ATOL,
                               err_msg=f"{case}: {key} of steps {sorted(got)}")
  # The data position went on from the restored one (and ends where the reference's does).
  assert _saved_data(tmp / case, STEPS)["train"]["position"] == \
      _saved_data(tmp / "ref", STEPS)["train"]["position"]

  want, have = saved_state(tmp / "ref", STEPS), saved_state(tmp / case, STEPS)
  assert sorted(have) == sorted(want)
  assert any(k.startswith("['emb']") for k in want) and "['rng']" in want
  worst, used, bad = {}, {}, []
  for key, w in want.items():
    h = have[key]
    assert (h.dtype, h.shape) == (w.dtype, w.shape), key
    if np.issubdtype(w.dtype, np.floating):
      d, w64 = np.abs(h.astype(np.float64) - w), np.abs(w.astype(np.float64))
      err = float(np.max(d, initial=0.0))
      tol = float(np.max(d / (ATOL + RTOL * w64), initial=0.0))  # <= 1 passes
    else:  # step, counters, RNG key data: exact
      err = float(np.max(np.abs(h.astype(np.int64) - w.astype(np.int64)), initial=0))
      tol = np.inf if err else 0.0
    g = _group(key)
    worst[g] = max(worst.get(g, 0.0), err)
    used[g] = max(used.get(g, 0.0), tol)
    if tol > 1:
      bad.append(f"{key}: max |diff| {err:.3g}")
  print(f"\n{model} {case}: per leaf group vs the 8-device run, max |diff| "
        "(max share of atol + rtol * |ref| used):",
        ", ".join(f"{g} {worst[g]:.3g} ({used[g]:.2g})" for g in sorted(worst)),
        f"; train_loss {loss_diff:.3g}")
  assert not bad, f"{case}: leaves off by more than atol={ATOL}, rtol={RTOL}:\n" + "\n".join(bad)
