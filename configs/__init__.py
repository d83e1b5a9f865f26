"""Run configs: one Python file per run setup, each defining get_config() -> a RunConfig."""
