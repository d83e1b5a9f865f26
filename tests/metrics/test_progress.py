import io

import pytest

from jrl.metrics import ProgressBar, format_duration


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_format_duration():
    assert [format_duration(s) for s in (0, 5, 62, 3725)] == ["0s", "5s", "1m02s", "1h02m05s"]
    assert format_duration(float("inf")) == "?"


def test_plain_output_every_n_steps_with_eta_and_latest_eval():
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(100, stream=stream, every=10, tty=False, clock=clock)
    bar.update(0, {"rollout/reward_mean": 0.1})
    for step in range(1, 21):
        clock.now += 2.0
        metrics = {"rollout/reward_mean": 0.5}
        if step == 10:
            metrics["eval/accuracy_greedy"] = 0.25
        bar.update(step, metrics)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # steps 0, 10, 20
    assert lines[0] == "step 0/100 | reward 0.100 | 0s elapsed"
    # 20 steps in 40 s -> 2 s/step; 80 steps left -> 160 s.
    assert lines[2] == "step 20/100 | reward 0.500 | eval 0.250 | 40s elapsed | ETA 2m40s"


def test_resumed_run_eta_counts_only_new_steps():
    clock = FakeClock()
    bar = ProgressBar(200, stream=io.StringIO(), tty=False, clock=clock)
    bar.render(100)
    clock.now += 10.0
    # 10 steps in 10 s -> 1 s/step; 90 left.
    assert bar.render(110).endswith("10s elapsed | ETA 1m30s")


def test_tty_shows_a_tqdm_bar_and_write_keeps_messages_separate():
    stream, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(10, stream=stream, tty=True, clock=clock)
    bar.update(1, {"rollout/reward_mean": 0.123456, "eval/accuracy": 0.5})
    bar.update(2)
    bar.write("saved checkpoint")
    bar.update(3)
    bar.close()
    text = stream.getvalue()
    assert "1/10" in text and "reward 0.123 | eval 0.500" in text
    assert "2/10" in text and "3/10" in text
    assert "saved checkpoint\n" in text
    assert text.endswith("\n")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"total_steps": 0}, "total_steps=0"), ({"total_steps": 5, "every": 0}, "every=0")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProgressBar(**kwargs)
