"""Config keys that moved (jrl.pipeline.config.migration): a config.json, a checkpoint's config
or a --set override written with the old keys is read under the new ones, one note per key,
and an old key given beside its new one is refused."""

import dataclasses
import json

import pytest

from jrl import losses
from jrl.cli import train
from jrl.pipeline.loop import resume
from jrl.pipeline.config import (AlgorithmSection, RolloutSection, RunConfig,
                                 SpeculativeSection, TrainSection, config_from_dict)
from jrl.pipeline.config.migration import MOVED_KEYS, migrate_dict, migrate_override
from jrl.pipeline.config.tools import to_dict

# The five flat rollout.speculative_* fields of a config.json written before the section.
OLD_ROLLOUT = {"speculative": 3, "speculative_ngram": 2, "speculative_draft": "fast_path",
               "speculative_min_accept": 0.25, "speculative_draft_pick": "target_key"}
NEW_SECTION = SpeculativeSection(num_draft=3, ngram_max=2, draft="fast_path",
                                 draft_min_accept=0.25, draft_pick="target_key")
# The loss section (preset, not recipe) and rollout's shaping keys of a config.json written
# before the algorithm section, with the train values such a run wrote out.
OLD_LOSS = {"preset": "dapo", "factory": None, "eps_low": 0.1, "eps_high": None, "kl_beta": 0.04,
            "kl_kind": "k2", "entropy_coef": 0.01, "std_power": 0.5, "unbiased_std": True,
            "tis_cap": 2.0, "mis_threshold": None, "mis_level": "token", "tis_level": "sequence",
            "kl_straight_through": False, "kl_importance_weighted": True,
            "load_balance_coef": 0.0}
OLD_SHAPING = {"dynamic_sampling": True, "overlong_buffer": 3, "overlong_factor": 0.5}
OLD_TRAIN = {"reference": "loss", "old_logp": "recompute"}
NEW_ALGORITHM = AlgorithmSection(recipe="dapo", eps_low=0.1, kl_beta=0.04, kl_kind="k2",
                                 entropy_coef=0.01, std_power=0.5, unbiased_std=True,
                                 tis_cap=2.0, tis_level="sequence", kl_importance_weighted=True,
                                 dynamic_sampling=True, overlong_buffer=3, overlong_factor=0.5)
NEW_CONFIG = RunConfig(rollout=RolloutSection(speculative=NEW_SECTION), algorithm=NEW_ALGORITHM,
                       train=TrainSection(**OLD_TRAIN))


def _old_config_json(**loss) -> dict:
    data = to_dict(RunConfig())
    data["rollout"].pop("speculative")
    data["rollout"].update(OLD_ROLLOUT, **OLD_SHAPING)
    data.pop("algorithm")
    data["loss"] = {**OLD_LOSS, **loss}
    data["train"].update(OLD_TRAIN)
    return data


def test_an_old_config_json_is_read_under_the_new_keys():
    notes = []
    config = config_from_dict(_old_config_json(), log=notes.append)
    assert config.rollout.speculative == NEW_SECTION
    assert config.algorithm == NEW_ALGORITHM
    assert config == NEW_CONFIG
    assert notes == [f"config key {old} is now {new}: read as {new}"
                     for old, new in MOVED_KEYS.items()]
    assert "config key loss.preset is now algorithm.recipe: read as algorithm.recipe" in notes
    assert "config key rollout.overlong_buffer is now algorithm.overlong_buffer: read as " \
           "algorithm.overlong_buffer" in notes
    # A config.json written with the section moves nothing.
    notes.clear()
    assert config_from_dict(json.loads(json.dumps(to_dict(config))), log=notes.append) == config
    assert notes == []


def test_every_field_of_the_old_loss_section_moves_to_the_algorithm_section():
    moved = {old.split(".", 1)[1]: new.split(".", 1)[1] for old, new in MOVED_KEYS.items()
             if old.startswith("loss.")}
    assert sorted(moved) == sorted(OLD_LOSS)
    assert set(moved.values()) | set(OLD_SHAPING) == \
        {field.name for field in dataclasses.fields(AlgorithmSection)}


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo"])
def test_an_old_symmetric_presets_one_clip_bound_reads_as_both(preset):
    """grpo and dr_grpo took one eps: loss.eps_low alone clipped both sides. The algorithm
    section's bounds mean the same for every recipe, so both are set to it."""
    notes = []
    config = config_from_dict(_old_config_json(preset=preset, eps_low=0.1), log=notes.append)
    assert (config.algorithm.eps_low, config.algorithm.eps_high) == (0.1, 0.1)
    assert notes[0] == (f"config key loss.eps_low=0.1 of preset {preset!r} clipped both sides: "
                        "read as algorithm.eps_low = algorithm.eps_high = 0.1")
    # The run's clip is the old one: PPOClip(0.1, 0.1).
    clip = next(t for t in config.recipe().loss.transforms if isinstance(t, losses.PPOClip))
    assert (clip.eps_low, clip.eps_high) == (0.1, 0.1)
    # A preset with two bounds keeps the other at the recipe's default (dapo: 0.28).
    config = config_from_dict(_old_config_json(eps_low=0.1), log=notes.append)
    assert (config.algorithm.eps_low, config.algorithm.eps_high) == (0.1, None)
    clip = next(t for t in config.recipe().loss.transforms if isinstance(t, losses.PPOClip))
    assert (clip.eps_low, clip.eps_high) == (0.1, 0.28)


def test_an_old_key_beside_its_new_one_is_refused():
    data = _old_config_json()
    data["rollout"]["speculative"] = {"num_draft": 2}
    data["rollout"]["speculative_ngram"] = 4
    data["rollout"]["speculative"]["ngram_max"] = 5
    with pytest.raises(ValueError, match="config keys rollout.speculative_ngram and "
                                         "rollout.speculative.ngram_max are both given"):
        migrate_dict(data)
    data = _old_config_json()
    data["algorithm"] = {"recipe": "grpo"}
    with pytest.raises(ValueError, match="config keys loss.preset and algorithm.recipe are both "
                                         "given"):
        migrate_dict(data)


def test_an_old_override_is_rewritten_with_a_note():
    assert migrate_override("rollout.speculative=4") == (
        "rollout.speculative.num_draft=4",
        "config key rollout.speculative is now rollout.speculative.num_draft: read as "
        "rollout.speculative.num_draft")
    assert migrate_override("rollout.speculative.num_draft=4") == (
        "rollout.speculative.num_draft=4", None)
    assert migrate_override("train.steps=4") == ("train.steps=4", None)
    assert migrate_override("loss.preset=dapo") == (
        "algorithm.recipe=dapo",
        "config key loss.preset is now algorithm.recipe: read as algorithm.recipe")
    assert migrate_override("rollout.dynamic_sampling=false")[0] == \
        "algorithm.dynamic_sampling=false"
    item, note = migrate_override("loss.eps_low=0.1")
    assert item == "algorithm.eps_low=0.1"
    assert note.endswith("(algorithm.eps_low / eps_high bound [1 - eps_low, 1 + eps_high] for "
                         "every recipe: for a symmetric clip set both)")


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
    config = train.load_config("arith_tiny", ["loss.preset=dapo", "loss.kl_beta=0",
                                              "rollout.overlong_buffer=4"])
    assert (config.algorithm.recipe, config.algorithm.overlong_buffer) == ("dapo", 4)
    assert config.resolved_train().reference == "none"     # no KL term: no reference model
    assert "--set: config key loss.preset is now algorithm.recipe" in capsys.readouterr().err


def test_a_checkpoint_config_with_old_keys_compares_by_the_new_ones():
    """resume compares the checkpoint's config with the run's: an old checkpoint's flat keys
    read as the section give no difference, and the log says which keys moved."""
    lines = []
    saved = resume._resolved_dict(_old_config_json(), lines.append)
    assert resume.dict_diffs(saved, to_dict(NEW_CONFIG.resolved())) == []
    assert lines[0].startswith("resume: the checkpoint's config key rollout.speculative is now")
    assert "resume: the checkpoint's config key loss.preset is now algorithm.recipe: read as " \
           "algorithm.recipe" in lines
    # The run's train.reference / old_logp left "auto" follow the recipe (its KL term and TIS)
    # to the values the checkpoint wrote out: no difference either.
    following = RunConfig(rollout=RolloutSection(speculative=NEW_SECTION),
                          algorithm=NEW_ALGORITHM)
    assert following.train.reference == "auto"
    assert resume.dict_diffs(saved, to_dict(following.resolved())) == []
    # A changed recipe is a difference, named by the new key.
    changed = dataclasses.replace(following, algorithm=dataclasses.replace(NEW_ALGORITHM,
                                                                           recipe="gspo"))
    assert resume.dict_diffs(saved, to_dict(changed.resolved())) == \
        ["algorithm.recipe: 'dapo' -> 'gspo'"]
