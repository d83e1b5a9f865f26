"""`jrl train` when the disk fills during a checkpoint write: one line with the cause first,
the intact checkpoint to resume from, exit 2 (Orbax's error pages are not printed)."""

import orbax.checkpoint as ocp

from jrl.cli import train

CONFIG = '''
from tests.pipeline.tiny import tiny_config

def get_config():
    return tiny_config("train.steps=3", "train.sft_steps=0", "checkpoint.every=1")
'''


def test_a_full_disk_at_the_second_checkpoint_is_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                       capsys):
    config = tmp_path / "tiny_cli.py"
    config.write_text(CONFIG)
    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step < 2:
            return real_save(self, step, *args, **kwargs)
        # As TensorStore reports it through Orbax: a ValueError carrying the errno (28, ENOSPC).
        raise ValueError("RESOURCE_EXHAUSTED: Error writing local file "
                         "\"ckpt/2/state/d/0\": [os_error_code='28'] No space left on device\n"
                         + "Traceback ...\n" * 40)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    code = train.main(["--config", str(config), "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    stopped = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(stopped) == 1 and "Traceback" not in err, err
    assert stopped[0].startswith("stopped: No space left on device (ENOSPC)")
    assert ("writing checkpoint step 2" in stopped[0] and "checkpoint 1 is intact" in stopped[0]
            and stopped[0].endswith("resume from step 1 with --resume once fixed")), stopped[0]
