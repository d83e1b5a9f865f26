"""The rollout side of a run: what a step's batch is (batch.py), the task that renders prompts and
scores responses (task.py), multi-turn episodes (episodes.py), and the sampler threads
(worker.py) fed by the admission queue (admission.py)."""
