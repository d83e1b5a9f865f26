import pathlib
import re

import pytest

from jrl.metrics import ALL_METRIC_NAMES, names

# Names added with the metrics package, next to docs/design.md's "Metric names" section.
ADDED_NAMES = """
rollout/reward_errors rollout/dropped_stale eval/accuracy_greedy eval/accuracy_sampled
train/loss train/lr
""".split()


def _design_names() -> list[str]:
    """The backticked names of docs/design.md's "Metric names" section."""
    design = (pathlib.Path(__file__).parents[2] / "docs" / "design.md").read_text()
    section = design.split("## Metric names")[1].split("\n## ")[0]
    return re.findall(r"`([a-z_]+/[a-z_]+)`", section)


def test_every_design_name_has_a_constant():
    design = _design_names()
    assert len(design) >= 20      # the section was found and read
    assert set(design + ADDED_NAMES) <= set(ALL_METRIC_NAMES)


def test_every_name_is_declared_with_a_meaning_and_a_reduction():
    assert set(names.REGISTRY) == set(ALL_METRIC_NAMES)
    for metric in names.REGISTRY.values():
        assert metric.meaning and metric.reduce in names.REDUCTIONS
    rows = [line.split("|")[1].strip() for line in names.table().splitlines()[2:]]
    families = [family.name for family in names.FAMILIES.values()]
    assert sorted(rows) == sorted([*ALL_METRIC_NAMES, *families])


def test_a_family_name_takes_its_declared_reduction_and_needs_a_name_after_the_prefix():
    part = names.reward_part("format")
    assert part == "rollout/reward_part/format" and names.reduction(part) == names.MEAN
    with pytest.raises(KeyError, match="not declared"):
        names.reduction("rollout/reward_part/")
    # Two hosts' shares of a rollout: the part's mean is weighted by their rows (1 and 3).
    out = names.combine_parts([{part: 1.0}, {part: 0.0}], weights=[1, 3])
    assert out[part] == 0.25                                          # (1 * 1 + 3 * 0) / 4


def test_a_metric_is_declared_once_and_undeclared_names_are_refused():
    with pytest.raises(ValueError, match="declared twice"):
        names.metric(names.TRAIN_LOSS, names.SUM, "again")
    with pytest.raises(KeyError, match="not declared in jrl.metrics.names"):
        names.reduction("train/undeclared_thing")


def test_combine_parts_uses_the_declared_reductions():
    parts = [{names.TRAIN_LOSS: 1.0, names.ROLLOUT_REWARD_MEAN: 0.5, names.TRAIN_RATIO_MAX: 1.2,
              names.TRAIN_RATIO_MIN: 0.9},
             {names.TRAIN_LOSS: 2.0, names.ROLLOUT_REWARD_MEAN: 0.2, names.TRAIN_RATIO_MAX: 1.1,
              names.TRAIN_RATIO_MIN: 0.7}]
    out = names.combine_parts(parts, weights=[1, 3])
    assert out[names.TRAIN_LOSS] == 3.0                                 # sum: 1 + 2
    assert out[names.ROLLOUT_REWARD_MEAN] == pytest.approx(0.275)       # (0.5 + 3 * 0.2) / 4
    assert out[names.TRAIN_RATIO_MAX] == 1.2 and out[names.TRAIN_RATIO_MIN] == 0.7


def test_combine_updates_averages_all_but_extremes():
    updates = [{names.TRAIN_LOSS: 1.0, names.TRAIN_RATIO_MAX: 1.2},
               {names.TRAIN_LOSS: 2.0, names.TRAIN_RATIO_MAX: 1.5}]
    out = names.combine_updates(updates)
    assert out[names.TRAIN_LOSS] == 1.5                                 # (1 + 2) / 2
    assert out[names.TRAIN_RATIO_MAX] == 1.5


def test_producers_use_the_registry_not_string_literals():
    """No metric name is spelled as a string literal in jrl/ outside the registry."""
    root = pathlib.Path(names.__file__).resolve().parents[1]
    pattern = re.compile(r"[\"'](?:rollout|train|time|mismatch|eval|sft)/[a-z_]+[\"']")
    offenders = [f"{path.relative_to(root)}: {match.group(0)}"
                 for path in root.rglob("*.py") if path.name != "names.py"
                 for match in pattern.finditer(path.read_text())]
    assert offenders == []


def test_names_are_unique_and_slash_separated():
    assert len(set(ALL_METRIC_NAMES)) == len(ALL_METRIC_NAMES)
    assert all(name.count("/") == 1 and name == name.lower() for name in ALL_METRIC_NAMES)
