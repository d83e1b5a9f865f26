"""jrl: a JAX functional RL trainer for language models."""
