"""Simulators that run the real policy code against modelled workers: routing trace replay
(`duet bench route`: trace_replay.py, baseline_policies.py) and the autoscaler replay (autoscale_sim.py)."""
