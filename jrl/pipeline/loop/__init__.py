"""The one run loop (runner.py) and what it runs with: the rollout sources of every mode
(sources.py; spmd.py; multihost.py and split_run.py for split processes), the warm start,
evaluation, checkpoints and resume, faults, the run directory and the summary."""
