"""scripts/chaos.py --processes 2 at a small scale: 3 seeded trials on 2 x 4 CPU devices.

Seed 8 draws SIGKILL to process 0 during compilation, SIGSTOP to process 0
mid-step (a hung host: process 1's step watchdog must end it) and SIGTERM to
process 0 during restore. After each, the survivors must exit within the stated
bound and the next launch must resume from the newest complete checkpoint; the
final state and losses must equal an uninterrupted 2 x 4 run's within the
tolerance (fp32 rounding of the cross-process reductions).

Slow: five launches, each compiling tiny in both processes (minutes on 2 cores).
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import chaos  # noqa: E402  pylint: disable=wrong-import-position
import chaos_multiprocess  # noqa: E402  pylint: disable=wrong-import-position

@pytest.mark.slow  # minutes of real training runs
def test_chaos_two_processes_small(tmp_path):
  out = chaos.main(["--processes", "2", "--trials", "3", "--seed", "8", "--workdir",
                    str(tmp_path)])
  print(out)
  assert out["processes"] == 2 and out["trials"] == 3
  assert out["sigkills"] == out["sigstops"] == out["sigterms"] == 1
  assert out["restarts_ok"] == 3 and out["checkpoints_lost"] == 0
  assert out["corrupt_restores"] == 0
  assert out["final_state_equal"] and out["losses_equal"]
  assert out["max_state_diff"] <= chaos_multiprocess.TOLERANCE
  assert out["survivors_in_bound"] == 3
  assert out["worst_time_to_exit_s"] <= out["exit_bound_s"] == chaos_multiprocess.EXIT_BOUND_S


def test_single_process_mode_keeps_its_keys():
  """The multi-process summary carries every key of the single-process one."""
  keys = {"trials", "restarts_ok", "checkpoints_lost", "corrupt_restores", "final_state_equal",
          "losses_equal", "steps", "sigkills", "sigterms", "startup_kills", "kills_during_save",
          "seconds"}
  src = open(os.path.join(ROOT, "scripts", "chaos_multiprocess.py"), encoding="utf-8").read()
  assert all(f'"{k}"' in src for k in keys)
