"""Config loading and validation: bad keys and values are rejected at start, naming the key."""

import pytest

from jrl.pipeline.config_tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.experiment import ExperimentConfig
from launch import train as train_cli
from tests.pipeline.tiny import tiny_config

CONFIGS = ["arith_tiny", "arith_tiny_async", "smollm2_arith", "gsm8k_qwen3_sync",
           "gsm8k_qwen3_async"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_loads_and_round_trips(name):
    config = train_cli.load_config(f"configs/{name}.py", [])
    assert from_dict(ExperimentConfig, to_dict(config)) == config


def test_overrides_are_typed():
    config = apply_overrides(tiny_config(), ["train.steps=7", "loss.tis_cap=2.5",
                                              "sampling.stop_tokens=(5, 6)",
                                              "pipeline.drop_stale_beyond=none",
                                              "eval.sampled=true"])
    assert config.train.steps == 7 and config.loss.tis_cap == 2.5
    assert config.sampling.stop_tokens == (5, 6) and config.pipeline.drop_stale_beyond is None
    assert config.eval.sampled is True


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown config key 'train.stepz'"),
    ("nosuch.key=1", "unknown config key 'nosuch.key'"),
    ("train.steps=many", "train.steps='many': expected an integer"),
    ("loss.preset=ppo", "loss.preset='ppo': allowed values are"),
    ("numerics.backend=cuda", "NumericalContract.backend='cuda': allowed values are"),
    ("sampling.top_p=1.5", "SamplingParams.top_p=1.5"),
    ("train.micro_batches=3", "train.micro_batches=3"),
    ("pipeline.kv_on_swap=drop", "pipeline.kv_on_swap='drop'"),
    ("train.steps", "expected key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace(".", r"\.")):
        apply_overrides(tiny_config(), [override])


def test_cli_rejects_bad_config_with_exit_code_2(capsys, tmp_path):
    code = train_cli.main(["--config", "configs/arith_tiny.py", "--set", "train.stepz=1",
                           "--workdir", str(tmp_path)])
    assert code == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err


def test_missing_files_give_clear_errors(capsys, tmp_path):
    assert train_cli.main(["--config", str(tmp_path / "nope.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    code = train_cli.main(["--config", "configs/gsm8k_qwen3_sync.py", "--workdir",
                           str(tmp_path)])
    assert code == 2
    assert "model.path='SET_ME': no such file or directory" in capsys.readouterr().err
