"""`jrl.cli.train --export-hf` refuses, before any training, what it could not write at the end."""

import errno
import os

import pytest

from jrl.cli import train

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


def test_export_with_split_processes_gets_the_same_checks(tmp_path, capsys):
    """A split run exports from its train process through the same code: the same checks
    apply (here: the character tokenizer has no files to export), none of its own."""
    assert _main(tmp_path, "--export-hf", str(tmp_path / "out"), "--split-processes") == 2
    err = capsys.readouterr().err
    assert "has no Hugging Face tokenizer files" in err
    assert "--split-processes" not in err


def test_export_needs_a_tokenizer_with_hf_files(tmp_path, capsys):
    # The tiny config's character tokenizer has no tokenizer.json to export.
    assert _main(tmp_path, "--export-hf", str(tmp_path / "out")) == 2
    assert "has no Hugging Face tokenizer files" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    # Refused before the workdir was claimed: the corrected command may use the same one (the
    # probe: a retry got "already holds a run", though nothing had trained).
    assert not os.path.exists(tmp_path / "run")
    assert _main(tmp_path) == 0


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_model_arch_overrides_of_a_checkpoint_are_refused(tmp_path, capsys, source):
    """model.arch.* with a checkpoint source was silently ignored, and config.json recorded a
    model that never existed."""
    code = _main(tmp_path, "--set", f"model.source={source}", "--set", "model.path=/ckpt",
                 "--set", "model.arch.num_layers=7")
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("--set model.arch.num_layers: model.arch.* describes the "
                                     f"model of model.source='random'; model.source='{source}'"
                                     ) in err
    assert not os.path.exists(tmp_path / "run")


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
    from jrl.cli.convert import peft_base_model

    assert peft_base_model(ModelSection(source="hf", path="checkpoints/base")) == \
        "checkpoints/base"
    assert peft_base_model(ModelSection(source="random")) is None


def test_export_onto_a_file_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("mine")
    assert _main(tmp_path, "--export-hf", str(target)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is a file, not a directory" in err
    assert target.read_text() == "mine" and not os.path.exists(tmp_path / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_export_under_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "is not a writable directory" in train._export_target_problem(
            str(locked / "new" / "out"))
    finally:
        locked.chmod(0o700)
    assert train._export_target_problem(str(tmp_path / "new" / "out")) is None


def test_a_full_disk_or_ctrl_c_during_export_is_one_line(tmp_path, capsys):
    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    assert train._export("--export-hf", str(tmp_path / "out"), full_disk) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("No space left on device (ENOSPC): "
                                                   "--export-hf")

    def interrupted():
        raise KeyboardInterrupt

    assert train._export("--export-hf", str(tmp_path / "out"), interrupted) == 130
    assert "nothing was written there" in capsys.readouterr().err


def test_ctrl_c_during_save_hf_leaves_nothing_half_written(tmp_path, monkeypatch):
    import jax

    from jrl.models import hf_checkpoint, transformer
    from jrl.models.config import ModelConfig
    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=8)
    params = transformer.init_params(config, jax.random.key(0), "float32")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_checkpoint, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_checkpoint.save_hf(tmp_path / "out", config, params, dtype="float32")
    assert os.listdir(tmp_path) == []          # no target, no staging directory
