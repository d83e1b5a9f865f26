import importlib.util
import sys

import pytest

from jrl.metrics import JsonlWriter
from jrl.cli import plot


def write_run(run_dir, steps=5):
    with JsonlWriter(run_dir / "metrics.jsonl") as writer:
        for step in range(steps):
            writer.write(
                step,
                {
                    "rollout/reward_mean": step / 10,
                    "train/entropy": 1.0 - step / 10,
                    "mismatch/logprob_abs_diff_max": 0.0,
                    "train/grad_norm": float("nan") if step == 2 else 1.0,
                },
            )
        writer.write(4, {"eval/accuracy_greedy": 0.4})


def test_collect_series_and_plan(tmp_path):
    write_run(tmp_path)
    records = plot.read_metrics(plot.resolve_metrics_path(str(tmp_path)))
    series = plot.collect_series(records)
    assert series["rollout/reward_mean"] == ([0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3, 0.4])
    assert series["eval/accuracy_greedy"] == ([4], [0.4])
    panels, notes = plot.plan_panels(series)
    assert [p.slug for p in panels] == [
        "reward",
        "eval_accuracy",
        "entropy",
        "grad_norm",
        "mismatch",
    ]
    assert any("skipped panel 'ref_kl'" in note for note in notes)
    assert any(
        "panel 'eval_accuracy': missing ['eval/accuracy', 'eval/accuracy_sampled', "
        "'eval/accuracy_greedy_last_number']" in n
        for n in notes
    )


def test_missing_file_and_no_plottable_metric(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot.resolve_metrics_path(str(tmp_path))
    with pytest.raises(ValueError, match="none of the plotted metrics"):
        plot.plot_metrics([{"step": 0, "other/x": 1.0}], str(tmp_path))


def test_matplotlib_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot.plot_metrics([{"step": 0, "rollout/reward_mean": 1.0}], str(tmp_path))


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed"
)
def test_main_writes_pngs(tmp_path, capsys):
    write_run(tmp_path)
    assert plot.main([str(tmp_path), "--per-panel"]) == 0
    out = capsys.readouterr().out
    assert "note: skipped panel 'ref_kl'" in out
    for name in ("metrics.png", "reward.png", "mismatch.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG")
    assert not (tmp_path / "plots" / "ref_kl.png").exists()


def test_wall_clock_is_the_cumulative_step_time_after_the_first():
    series = plot.collect_series([{"step": 1, "time/step_s": 0.5}, {"step": 2, "time/step_s": 1.5},
                                  {"step": 3, "time/step_s": 2.0}])
    # The first step (compilation) counts as 0: 0, 0 + 1.5, 1.5 + 2.0.
    assert plot.wall_clock(series) == {1: 0.0, 2: 1.5, 3: 3.5}


def test_overlay_of_several_runs(tmp_path, capsys):
    for name in ("a", "b"):
        write_run(tmp_path / name)
    # Run b lacks the reward metric: the panel is drawn for a and b is noted.
    (tmp_path / "c").mkdir()
    with JsonlWriter(tmp_path / "c" / "metrics.jsonl") as writer:
        writer.write(1, {"train/entropy": 0.5, "time/step_s": 1.0})
    runs = [str(tmp_path / name) for name in ("a", "b", "c")]
    assert plot.main(runs + ["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "panel 'reward': run 'c' has none of its metrics" in out
    assert "skipped panel 'ref_kl'" in out
    assert (tmp_path / "out" / "metrics.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="no panel"):
        plot.plot_overlay({"c": [{"step": 1, "other/x": 1.0}]}, str(tmp_path / "x.png"))


def test_metric_labels_keep_the_full_name_where_last_parts_collide():
    from jrl.cli.plot import metric_labels
    assert metric_labels(("rollout/tool_calls_mean", "eval/tool_calls_mean",
                          "rollout/turns_mean")) == {
        "rollout/tool_calls_mean": "rollout/tool_calls_mean",
        "eval/tool_calls_mean": "eval/tool_calls_mean", "rollout/turns_mean": "turns_mean"}
