"""The train side of a run: a rollout batch made a complete TrainBatch (prepare.py, batching.py,
routing.py), the Trainer that updates, holds and publishes the weights (trainer.py), and one RL
step of prepare -> train -> publish (rl_step.py)."""
