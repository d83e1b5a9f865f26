"""The metrics section (jrl.pipeline.config.metrics): one list of backends, what each setting
hands jrl.metrics.writers.make_writers, the errors that name the key, and the old top-level
tensorboard / wandb keys read into it (jrl.pipeline.config.migration), one note per key."""

import json
import re

import pytest

from jrl.cli import train
from jrl.pipeline.config import MetricsSection, RunConfig, config_from_dict
from jrl.pipeline.config.migration import migrate_dict, migrate_overrides
from jrl.pipeline.config.tools import apply_overrides, to_dict
from jrl.pipeline.loop import resume


@pytest.mark.parametrize("section, tensorboard, wandb", [
    (MetricsSection(), "auto", "false"),          # unset: jsonl, TensorBoard where installed
    (MetricsSection(backends=("jsonl",)), False, "false"),
    (MetricsSection(backends=("jsonl", "tensorboard")), True, "false"),
    (MetricsSection(backends=("jsonl", "wandb")), False, "online"),
    (MetricsSection(backends=("jsonl", "tensorboard", "wandb"), wandb_mode="offline"), True,
     "offline"),
])
def test_the_backends_are_what_make_writers_gets(section, tensorboard, wandb):
    assert (section.tensorboard, section.wandb) == (tensorboard, wandb)


def test_the_list_is_set_from_the_command_line_and_round_trips():
    config = apply_overrides(RunConfig(), ["metrics.backends=[jsonl, tensorboard, wandb]",
                                           "metrics.wandb_mode=offline"])
    assert config.metrics == MetricsSection(backends=("jsonl", "tensorboard", "wandb"),
                                            wandb_mode="offline")
    assert apply_overrides(RunConfig(), ["metrics.backends=jsonl,wandb"]).metrics.backends == \
        ("jsonl", "wandb")
    assert apply_overrides(config, ["metrics.backends=null", "metrics.wandb_mode=online"]
                           ).metrics == MetricsSection()
    notes = []
    assert config_from_dict(json.loads(json.dumps(to_dict(config))), log=notes.append) == config
    assert notes == []


@pytest.mark.parametrize("override, message", [
    ("metrics.backends=[tensorboard]", "metrics.backends=['tensorboard']: must list 'jsonl' "
                                       "(summary.json, jrl plot and resume read metrics.jsonl)"),
    ("metrics.backends=[jsonl,jsonl]", "metrics.backends=['jsonl', 'jsonl']: names a backend "
                                       "twice"),
    ("metrics.backends=[jsonl,csv]", "metrics.backends: unknown backend 'csv'; allowed: "
                                     "['jsonl', 'tensorboard', 'wandb']"),
    ("metrics.wandb_mode=offline", "metrics.wandb_mode='offline' is not used: metrics.backends "
                                   "does not list wandb"),
])
def test_a_bad_metrics_section_is_one_error_naming_the_key(override, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        apply_overrides(RunConfig(), [override])


def _old_config_json(**old) -> dict:
    data = to_dict(RunConfig())
    data.pop("metrics")
    data.update(old)
    return data


@pytest.mark.parametrize("old, section", [
    # Every config.json written before the section holds both keys at their defaults.
    (dict(tensorboard="auto", wandb="false"), MetricsSection()),
    (dict(tensorboard="false", wandb="false"), MetricsSection(backends=("jsonl",))),
    (dict(tensorboard="true"), MetricsSection(backends=("jsonl", "tensorboard"))),
    (dict(tensorboard="true", wandb="offline"),
     MetricsSection(backends=("jsonl", "tensorboard", "wandb"), wandb_mode="offline")),
    (dict(tensorboard="auto", wandb="online"), MetricsSection(backends=("jsonl", "wandb"))),
])
def test_an_old_config_json_reads_its_tensorboard_and_wandb_keys(old, section):
    notes = []
    assert config_from_dict(_old_config_json(**old), log=notes.append).metrics == section
    assert len(notes) == len(old)
    read_as = f"metrics.backends={list(section.backends) if section.backends else 'unset'}"
    assert notes[0] == f"config key {next(iter(old))}={next(iter(old.values()))!r} is now " \
                       f"metrics.backends: read as {read_as}" + (
                           f", metrics.wandb_mode={section.wandb_mode!r}"
                           if section.backends and "wandb" in section.backends else "") + (
                           " (TensorBoard where installed has no list form: add tensorboard "
                           "to metrics.backends to keep it)"
                           if old == dict(tensorboard="auto", wandb="online") else "")


def test_old_metrics_keys_beside_the_section_or_with_a_bad_value_are_refused():
    data = _old_config_json(wandb="online")
    data["metrics"] = {"backends": ["jsonl"]}
    with pytest.raises(ValueError, match=r"^config keys wandb and metrics are both given"):
        migrate_dict(data)
    with pytest.raises(ValueError, match=r"^config key tensorboard='maybe' \(now "
                                         r"metrics\.backends\): allowed values are \['auto', "
                                         r"'true', 'false'\]$"):
        migrate_dict(_old_config_json(tensorboard="maybe"))


def test_old_overrides_become_metrics_items_together():
    items, notes = migrate_overrides(["tensorboard=true", "train.steps=3", "wandb=offline"])
    assert items == ["train.steps=3", "metrics.backends=[jsonl,tensorboard,wandb]",
                     "metrics.wandb_mode=offline"]
    assert len(notes) == 2
    assert migrate_overrides(["tensorboard=auto"])[0] == ["metrics.backends=null"]
    assert migrate_overrides(["tensorboard=false"])[0] == ["metrics.backends=[jsonl]"]
    assert migrate_overrides(["train.steps=3"]) == (["train.steps=3"], [])


def test_the_cli_reads_old_metrics_overrides(capsys):
    config = train.load_config("arith_tiny", ["wandb=offline"])
    assert config.metrics == MetricsSection(backends=("jsonl", "wandb"), wandb_mode="offline")
    assert "--set: config key wandb='offline' is now metrics.backends: read as " \
           "metrics.backends=['jsonl', 'wandb'], metrics.wandb_mode='offline'" in \
           capsys.readouterr().err


def test_a_checkpoint_config_with_the_old_keys_compares_by_the_section():
    lines = []
    saved = resume._resolved_dict(_old_config_json(tensorboard="auto", wandb="false"),
                                  lines.append)
    assert resume.dict_diffs(saved, to_dict(RunConfig().resolved())) == []
    assert any("config key tensorboard='auto' is now metrics.backends" in line for line in lines)
