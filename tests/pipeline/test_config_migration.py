"""Config keys that moved (jrl.pipeline.config_migration): a config.json, a checkpoint's config
or a --set override written with the old keys is read under the new ones, one note per key,
and an old key given beside its new one is refused."""

import json

import pytest

from jrl.cli import train
from jrl.pipeline import resume
from jrl.pipeline.config import (RolloutSection, RunConfig, SpeculativeSection,
                                 config_from_dict)
from jrl.pipeline.config_migration import MOVED_KEYS, migrate_dict, migrate_override
from jrl.pipeline.config_tools import to_dict

# The five flat rollout.speculative_* fields of a config.json written before the section.
OLD_ROLLOUT = {"speculative": 3, "speculative_ngram": 2, "speculative_draft": "fast_path",
               "speculative_min_accept": 0.25, "speculative_draft_pick": "target_key"}
NEW_SECTION = SpeculativeSection(num_draft=3, ngram_max=2, draft="fast_path",
                                 draft_min_accept=0.25, draft_pick="target_key")


def _old_config_json() -> dict:
    data = to_dict(RunConfig())
    data["rollout"].pop("speculative")
    data["rollout"].update(OLD_ROLLOUT)
    return data


def test_an_old_config_json_is_read_under_the_new_keys():
    notes = []
    config = config_from_dict(_old_config_json(), log=notes.append)
    assert config.rollout.speculative == NEW_SECTION
    assert config == RunConfig(rollout=RolloutSection(speculative=NEW_SECTION))
    assert notes == [f"config key {old} is now {new}: read as {new}"
                     for old, new in MOVED_KEYS.items()]
    # A config.json written with the section moves nothing.
    notes.clear()
    assert config_from_dict(json.loads(json.dumps(to_dict(config))), log=notes.append) == config
    assert notes == []


def test_an_old_key_beside_its_new_one_is_refused():
    data = _old_config_json()
    data["rollout"]["speculative"] = {"num_draft": 2}
    data["rollout"]["speculative_ngram"] = 4
    data["rollout"]["speculative"]["ngram_max"] = 5
    with pytest.raises(ValueError, match="config keys rollout.speculative_ngram and "
                                         "rollout.speculative.ngram_max are both given"):
        migrate_dict(data)


def test_an_old_override_is_rewritten_with_a_note():
    assert migrate_override("rollout.speculative=4") == (
        "rollout.speculative.num_draft=4",
        "config key rollout.speculative is now rollout.speculative.num_draft: read as "
        "rollout.speculative.num_draft")
    assert migrate_override("rollout.speculative.num_draft=4") == (
        "rollout.speculative.num_draft=4", None)
    assert migrate_override("train.steps=4") == ("train.steps=4", None)


def test_the_cli_reads_old_overrides_and_an_old_config_json(tmp_path, capsys):
    config = train.load_config("arith_tiny", ["rollout.speculative=3",
                                              "rollout.speculative_draft=fast_path"])
    assert config.rollout.speculative.num_draft == 3
    assert config.rollout.speculative.draft == "fast_path"
    err = capsys.readouterr().err
    assert "--set: config key rollout.speculative_draft is now rollout.speculative.draft" in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_old_config_json()))
    assert train.load_config(str(path), []).rollout.speculative == NEW_SECTION
    assert "config key rollout.speculative_min_accept is now" in capsys.readouterr().err


def test_a_checkpoint_config_with_old_keys_compares_by_the_new_ones():
    """resume compares the checkpoint's config with the run's: an old checkpoint's flat keys
    read as the section give no difference, and the log says which keys moved."""
    lines = []
    config = RunConfig(rollout=RolloutSection(speculative=NEW_SECTION))
    saved = resume._resolved_dict(_old_config_json(), lines.append)
    assert resume.dict_diffs(saved, to_dict(config.resolved())) == []
    assert lines[0].startswith("resume: the checkpoint's config key rollout.speculative is now")
