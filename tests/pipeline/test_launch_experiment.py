"""launch.experiment: every experiment's runs are valid configs, shared run names mean the same
settings, and the summary table's arithmetic. (The runs themselves: docs/experiments.)"""

import pytest

from jrl.pipeline.config.tools import apply_overrides
from launch import experiment
from jrl.cli.train import load_config


@pytest.mark.parametrize("name", sorted(experiment.EXPERIMENTS))
def test_every_run_is_a_valid_config(name):
    spec = experiment.EXPERIMENTS[name]
    base = load_config(spec.base, [])
    for run_name, overrides in spec.runs.items():
        config = apply_overrides(base, overrides)   # raises on an unknown key or bad value
        if "pallas_k" in run_name:
            assert config.pipeline.max_staleness == int(run_name.split("_k")[1][0])


def test_a_run_name_means_the_same_settings_in_every_experiment():
    seen = {}
    for spec in experiment.EXPERIMENTS.values():
        for run_name, overrides in spec.runs.items():
            key = (spec.base, tuple(overrides))
            assert seen.setdefault(run_name, key) == key, run_name


def test_summaries_and_table():
    records = [{"step": s, "m": float(s)} for s in range(1, 13)] + [{"step": 12, "e": 0.5}]
    assert experiment.summarize(records, "m", "first") == 1.0
    assert experiment.summarize(records, "m", "first - 1") == 0.0
    assert experiment.summarize(records, "m", "last") == 12.0
    assert experiment.summarize(records, "m", "mean") == 6.5      # (1 + 12) / 2
    assert experiment.summarize(records, "m", "mean after first") == 7.0   # (2 + 12) / 2
    assert experiment.summarize(records, "m", "head") == 5.5      # mean of 1..10
    assert experiment.summarize(records, "m", "tail") == 7.5      # mean of 3..12
    assert experiment.summarize(records, "absent", "mean") is None
    spec = experiment.Experiment("t", "b", {}, (), (("m last", "m", "last"),
                                                   ("e", "e", "first"), ("x", "x", "mean")))
    text = experiment.table(spec, {"run_a": records})
    assert text.splitlines() == ["| run | m last | e | x |", "|---|---|---|---|",
                                 "| run_a | 12 | 0.5 | - |"]
