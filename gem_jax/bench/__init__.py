"""Benchmark library: step timing, the TorchRec peer (data and runner), the scale model.

  timing.py    step-time statistics, machine load, CPU contention meter
  peer.py      the TorchRec peer: its synthetic data as a gem_jax source, its command
  runner.py    one benchmark run of a config (reuses the trainer's setup and step)
  network.py   communication volumes of a sharding plan and a network model -> projection
"""
