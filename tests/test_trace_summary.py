"""trace_summary: the top ops of a profiler trace, device timelines preferred."""
import gzip
import json
import os

import pytest

from gem_jax.bench import trace_summary


def _write(tmp_path, events):
  d = tmp_path / "plugins" / "profile" / "run"
  os.makedirs(d)
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  return str(tmp_path)


def _meta(pid, name):
  return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def test_device_ops_only_when_a_device_timeline_exists(tmp_path):
  events = [_meta(1, "/host:CPU"), _meta(2, "/device:GPU:0"),
            {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "dur": 900.0, "ts": 0.0},
            {"ph": "X", "pid": 2, "name": "fusion.3", "ts": 0.0, "dur": 100.0},
            {"ph": "X", "pid": 2, "name": "fusion.3", "ts": 1000.0, "dur": 100.0},
            {"ph": "X", "pid": 2, "name": "gemm_fusion_dot.1", "ts": 2000.0, "dur": 600.0},
            {"ph": "X", "pid": 2, "name": "fusion.7", "ts": 3000.0, "dur": 200.0}]
  ops = trace_summary.summarize(_write(tmp_path, events), steps=2)
  assert [o["op"] for o in ops] == ["gemm_fusion_dot.1", "fusion.3", "fusion.7"]
  assert ops[0]["ms_per_step"] == pytest.approx(0.3)
  assert ops[1]["calls_per_step"] == 1.0
  assert ops[0]["share"] == pytest.approx(0.6)
  assert trace_summary.by_kind(ops) == pytest.approx({"gemm_fusion_dot": 0.6, "fusion": 0.4})


def test_host_thunks_without_the_executor_wrappers_on_cpu(tmp_path):
  events = [_meta(1, "/host:CPU"),
            {"ph": "X", "pid": 1, "name": "ThunkExecutor::Execute", "ts": 4000.0, "dur": 500.0},
            {"ph": "X", "pid": 1, "name": "dot.4", "ts": 5000.0, "dur": 300.0},
            {"ph": "X", "pid": 1, "name": "ParseArguments", "ts": 6000.0, "dur": 50.0},
            {"ph": "X", "pid": 1, "name": "reduce.2", "ts": 7000.0, "dur": 100.0}]
  ops = trace_summary.summarize(_write(tmp_path, events), steps=1)
  assert [o["op"] for o in ops] == ["dot.4", "reduce.2"]
  assert "dot.4" in trace_summary.format_top(ops)


def test_a_missing_trace_names_the_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    trace_summary.summarize(str(tmp_path), steps=1)


def test_nested_events_count_their_self_time(tmp_path):
  """A CPU while thunk spans its body's thunks: the body is not counted twice."""
  events = [_meta(1, "/host:CPU"),
            {"ph": "X", "pid": 1, "tid": 7, "name": "while.3", "ts": 0.0, "dur": 500.0},
            {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.1", "ts": 10.0, "dur": 200.0},
            {"ph": "X", "pid": 1, "tid": 7, "name": "fusion.2", "ts": 250.0, "dur": 100.0},
            {"ph": "X", "pid": 1, "tid": 8, "name": "fusion.2", "ts": 100.0, "dur": 100.0},
            {"ph": "X", "pid": 1, "tid": 7, "name": "dot.4", "ts": 600.0, "dur": 300.0}]
  ops = {o["op"]: o for o in trace_summary.summarize(_write(tmp_path, events), steps=1)}
  assert ops["while.3"]["ms_per_step"] == pytest.approx(0.2)   # 500 less its body's 300
  assert ops["fusion.1"]["ms_per_step"] == pytest.approx(0.2)
  assert ops["fusion.2"]["ms_per_step"] == pytest.approx(0.2)  # one in the loop, one beside it
  assert ops["dot.4"]["ms_per_step"] == pytest.approx(0.3)
  assert sum(o["share"] for o in ops.values()) == pytest.approx(1.0)
  assert ops["dot.4"]["share"] == pytest.approx(0.3 / 0.9)
