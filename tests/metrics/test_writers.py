import json
import math
import sys
import types
import warnings

import numpy as np
import pytest

from jrl.metrics import (
    JsonlWriter,
    MultiWriter,
    NullWriter,
    TensorBoardWriter,
    make_writers,
    read_metrics,
    tensorboard_available,
)


def strict_lines(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_writes_one_strict_json_object_per_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(0, {"rollout/reward_mean": np.float32(0.25), "train/grad_norm": np.array(2.0)})
        writer.write(
            1,
            {
                "train/loss": float("nan"),
                "train/grad_norm": np.float64("inf"),
                "ok": True,
                "n": np.int64(3),
            },
        )
        # Flushed at every write: readable before close.
        assert len(path.read_text().splitlines()) == 2
    assert strict_lines(path) == [
        {"step": 0, "rollout/reward_mean": 0.25, "train/grad_norm": 2.0},
        {
            "step": 1,
            "train/loss": None,
            "train/grad_norm": None,
            "ok": True,
            "n": 3,
            "nonfinite": {"train/loss": "nan", "train/grad_norm": "inf"},
        },
    ]
    records = read_metrics(path)
    assert math.isnan(records[1]["train/loss"]) and records[1]["train/grad_norm"] == math.inf
    assert "nonfinite" not in records[1]


def test_rejects_arrays_and_bad_names(tmp_path):
    with JsonlWriter(tmp_path / "m.jsonl") as writer:
        with pytest.raises(ValueError, match=r"'train/entropy' has shape \(2,\)"):
            writer.write(0, {"train/entropy": np.zeros(2)})
        with pytest.raises(ValueError, match="metric 'x' has value"):
            writer.write(0, {"x": object()})
        with pytest.raises(ValueError, match="metric name 'step'"):
            writer.write(0, {"step": 1})
        with pytest.raises(ValueError, match="step=-1"):
            writer.write(-1, {})


def test_resume_appends_and_truncates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlWriter(path) as writer:
        for step in range(6):
            writer.write(step, {"train/loss": float(step)})
    resumed = JsonlWriter(path)
    assert resumed.last_step == 5
    with pytest.raises(ValueError, match="step=4 is below the last step 5.*truncate_after"):
        resumed.write(4, {"train/loss": 0.0})
    assert resumed.truncate_after(3) == 2  # steps 4 and 5 removed
    resumed.write(4, {"train/loss": 40.0})
    resumed.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(path)] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_partial_last_line_from_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":0,"a":1}\n{"step":1,"a"')
    with pytest.warns(UserWarning, match="unterminated last line"):
        assert read_metrics(path) == [{"step": 0, "a": 1}]
    with pytest.warns(UserWarning, match="removing an unterminated last line"):
        writer = JsonlWriter(path)
    writer.write(1, {"a": 2})
    writer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_metrics(path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]


def test_malformed_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":0}\nnot json\n{"step":1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed"):
        read_metrics(path)


def test_make_writers_main_and_other_processes(tmp_path):
    writers = make_writers(tmp_path / "main", tensorboard=False)
    writers.write(0, {"a": 1.0})
    writers.close()
    assert read_metrics(tmp_path / "main" / "metrics.jsonl") == [{"step": 0, "a": 1.0}]

    others = make_writers(tmp_path / "other", tensorboard=False, is_main_process=False)
    assert isinstance(others.writers[0], NullWriter)
    others.write(0, {"a": 1.0})
    assert not (tmp_path / "other").exists()


def test_make_writers_resume_step(tmp_path):
    with make_writers(tmp_path, tensorboard=False) as writers:
        for step in range(4):
            writers.write(step, {"a": step})
    with make_writers(tmp_path, tensorboard=False, resume_step=1) as writers:
        writers.write(2, {"a": 20})
    assert [r["a"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 20]


def test_make_writers_rejects_bad_tensorboard_choice(tmp_path):
    with pytest.raises(ValueError, match=r"tensorboard='yes'.*\('auto', True, False\)"):
        make_writers(tmp_path, tensorboard="yes")
    with pytest.raises(ValueError, match="tensorboard=1"):
        make_writers(tmp_path, tensorboard=1)


@pytest.mark.skipif(
    tensorboard_available() is not None, reason="a TensorBoard backend is installed"
)
def test_tensorboard_required_but_missing(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboardX"):
        make_writers(tmp_path, tensorboard=True)
    writers = make_writers(tmp_path, tensorboard="auto")
    assert [type(w).__name__ for w in writers.writers] == ["JsonlWriter"]
    writers.close()


def test_tensorboard_writer_with_a_fake_tensorboardx(tmp_path, monkeypatch):
    calls = []

    class FakeSummaryWriter:
        def __init__(self, logdir):
            calls.append(("init", logdir))

        def add_scalar(self, name, value, global_step):
            calls.append((name, value, global_step))

        def flush(self):
            calls.append(("flush",))

        def close(self):
            calls.append(("close",))

    fake = types.ModuleType("tensorboardX")
    fake.SummaryWriter = FakeSummaryWriter
    fake.__spec__ = types.SimpleNamespace(
        name="tensorboardX"
    )  # find_spec reads it from sys.modules
    monkeypatch.setitem(sys.modules, "tensorboardX", fake)
    with make_writers(tmp_path, tensorboard="auto") as writers:
        assert isinstance(writers, MultiWriter)
        writers.write(3, {"rollout/reward_mean": np.float32(0.5), "note": "text", "none": None})
    assert calls == [
        ("init", str(tmp_path / "tensorboard")),
        ("rollout/reward_mean", 0.5, 3),
        ("close",),
    ]
    assert isinstance(writers.writers[1], TensorBoardWriter)
