"""The Weights & Biases writer (jrl.metrics.writers.WandbWriter), in offline mode: the real
package writes its run under the workdir, numeric metrics reach run.log at their step, and a
resumed writer continues the same W&B run."""

import sys

import numpy as np
import pytest

from jrl.metrics.writers import WANDB_ID_FILE, WandbWriter, make_writers

pytest.importorskip("wandb")


def _offline_runs(workdir):
    return sorted(p.name for p in (workdir / "wandb").glob("offline-run-*"))


def test_offline_run_logs_the_numeric_metrics_at_their_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "jrl-test")
    writers = make_writers(tmp_path, tensorboard=False, wandb="offline", run_name="tiny",
                           run_config={"train": {"steps": 2}})
    (writer,) = [w for w in writers.writers if isinstance(w, WandbWriter)]
    logged = []
    real_log = writer.run.log
    monkeypatch.setattr(writer.run, "log", lambda data, step: (logged.append((step, data)),
                                                                real_log(data, step=step)))
    writers.write(1, {"train/loss": np.float32(1.5), "eval/accuracy": 0.25, "note": "text",
                      "flag": True})
    writers.write(2, {"train/loss": 1.25})
    writers.close()
    # Strings are skipped, a bool is 0 / 1, numpy scalars become floats.
    assert logged == [(1, {"train/loss": 1.5, "eval/accuracy": 0.25, "flag": 1.0}),
                      (2, {"train/loss": 1.25})]
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    (run_dir,) = _offline_runs(tmp_path)
    assert run_dir.endswith(run_id) and (tmp_path / "wandb" / run_dir /
                                         f"run-{run_id}.wandb").stat().st_size > 0
    assert (tmp_path / "metrics.jsonl").exists()              # jsonl is always written too


def test_a_resumed_writer_continues_the_same_wandb_run(tmp_path):
    first = WandbWriter(tmp_path, mode="offline", name="tiny")
    first.write(1, {"train/loss": 1.0})
    first.close()
    second = WandbWriter(tmp_path, mode="offline", name="tiny")
    second.write(2, {"train/loss": 0.5})
    second.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert first.run.id == second.run.id == run_id


def test_without_the_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'jrl\[wandb\]'"):
        WandbWriter(tmp_path, mode="offline", name="tiny")
    with pytest.raises(ValueError, match="mode='onlin'"):
        WandbWriter(tmp_path, mode="onlin", name="tiny")
