"""`launch.train --export-hf` refuses, before any training, what it could not write at the end."""

import os

from launch import train

CONFIG = '''
from tests.pipeline.tiny import tiny_config

def get_config():
    return tiny_config("train.steps=1", "train.sft_steps=0")
'''


def _main(tmp_path, *extra):
    config = tmp_path / "tiny_cli.py"
    config.write_text(CONFIG)
    return train.main(["--config", str(config), "--workdir", str(tmp_path / "run"), *extra])


def test_export_into_a_non_empty_directory_is_refused(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert _main(tmp_path, "--export-hf", str(taken)) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (taken / "keep.txt").read_text() == "mine"          # nothing overwritten
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")   # nothing trained


def test_export_with_split_processes_is_refused(tmp_path, capsys):
    assert _main(tmp_path, "--export-hf", str(tmp_path / "out"), "--split-processes") == 2
    assert "not supported with --split-processes" in capsys.readouterr().err


def test_export_needs_a_tokenizer_with_hf_files(tmp_path, capsys):
    # The tiny config's character tokenizer has no tokenizer.json to export.
    assert _main(tmp_path, "--export-hf", str(tmp_path / "out")) == 2
    assert "has no Hugging Face tokenizer files" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_export_peft_is_refused_without_adapters_or_into_a_non_empty_directory(tmp_path, capsys):
    assert _main(tmp_path, "--export-peft", str(tmp_path / "adapter")) == 2
    assert "writes LoRA adapters: set model.lora.rank > 0" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert _main(tmp_path, "--export-peft", str(taken), "--set", "model.lora.rank=4") == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (taken / "keep.txt").read_text() == "mine"
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")   # nothing trained


def test_peft_adapter_points_at_the_loaded_base_not_the_merged_export():
    from jrl.pipeline.config import ModelSection
    from launch.convert import peft_base_model

    assert peft_base_model(ModelSection(source="hf", path="checkpoints/base")) == \
        "checkpoints/base"
    assert peft_base_model(ModelSection(source="random")) is None
