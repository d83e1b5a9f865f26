"""A run config made a run's parts: build_parts (parts.py) from the model (model.py), the prompts
(data.py, data_checks.py), the devices (devices.py), the samplers (samplers.py) and every part's
options read from the config (options.py)."""
