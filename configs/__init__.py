"""Experiment configs: one Python file per experiment, each defining get_config()."""
