"""jrl.stop_request: SIGINT / SIGTERM become a flag that check points raise, so a signal that lands
where Python drops exceptions (a garbage-collection callback) is still honoured."""

import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jrl import stop_request
from jrl.pipeline.loop.faults import interrupts_deferred

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def installed():
    """The recording handler for the test, then the process's own handlers back."""
    previous = {s: signal.getsignal(s) for s in stop_request.STOP_SIGNALS}
    stop_request.reset()
    stop_request.install()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_request.reset()
        stop_request.watch_checkpoints(None)


def _signal_inside_gc(signum):
    """Runs a forced gc.collect() whose callback receives `signum` (raise_signal runs the handler
    right there, inside the callback, as a signal landing during collection does)."""
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            signal.raise_signal(signum)

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert fired


def test_a_raising_handler_loses_a_signal_inside_gc(monkeypatch):
    """The control: the handler the CLI had (raise KeyboardInterrupt) is dropped by Python inside
    a gc callback ("Exception ignored in ..."), so nothing reaches the caller."""
    previous = signal.getsignal(signal.SIGTERM)
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_type))

    def raising(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, raising)
    try:
        _signal_inside_gc(signal.SIGTERM)     # returns normally: the signal is lost
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert dropped == [KeyboardInterrupt]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_inside_gc_is_honoured_at_the_next_check_point(installed, signum):
    _signal_inside_gc(signum)
    assert stop_request.requested() == signum
    assert stop_request.exit_status() == 128 + signum      # 130 for SIGINT, 143 for SIGTERM
    with pytest.raises(stop_request.StopRequested) as raised:
        stop_request.check_stop()
    assert raised.value.signum == signum and isinstance(raised.value, KeyboardInterrupt)


def test_without_a_signal_check_points_pass(installed):
    stop_request.check_stop()
    assert stop_request.requested() is None and stop_request.exit_status() is None


def test_outside_stop_at_once_the_handler_raises_nothing(installed):
    finished = []
    os.kill(os.getpid(), signal.SIGTERM)
    finished.append("after the signal")        # not cut short
    assert finished == ["after the signal"] and stop_request.requested() == signal.SIGTERM


def test_inside_stop_at_once_the_handler_raises_and_the_flag_stays(installed):
    with pytest.raises(stop_request.StopRequested):
        with stop_request.stop_at_once():
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("not reached: the signal raises at once here")
    # A raise that Python dropped would still be caught by the next check point.
    with pytest.raises(stop_request.StopRequested):
        stop_request.check_stop()


def test_stop_at_once_raises_on_entry_for_a_pending_request(installed):
    _signal_inside_gc(signal.SIGTERM)
    with pytest.raises(stop_request.StopRequested):
        with stop_request.stop_at_once():
            pytest.fail("not reached")


def test_interrupts_deferred_leaves_the_recording_handler_in_place(installed):
    with interrupts_deferred():
        assert stop_request.is_installed()
        os.kill(os.getpid(), signal.SIGTERM)
    assert stop_request.requested() == signal.SIGTERM     # recorded, nothing raised


def test_without_install_check_stop_does_nothing_and_ctrl_c_is_pythons():
    stop_request.reset()
    stop_request.check_stop()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_last_intact_checkpoint_skips_unfinished_folders(tmp_path):
    for name in ("3", "5", "7.orbax-checkpoint-tmp-1733", "notes"):
        (tmp_path / name).mkdir()
    assert stop_request.last_intact_checkpoint(str(tmp_path)) == 5
    assert stop_request.last_intact_checkpoint(str(tmp_path / "missing")) is None
    assert stop_request.last_intact_checkpoint(None) is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_exits_at_once_naming_the_last_intact_checkpoint(tmp_path, signum):
    for name in ("4", "6", "8.orbax-checkpoint-tmp-99"):
        (tmp_path / name).mkdir()
    script = textwrap.dedent(f"""
        import os, signal, time
        from jrl import stop_request
        stop_request.install()
        stop_request.watch_checkpoints({str(tmp_path)!r})
        os.kill(os.getpid(), {int(signum)})      # the first: recorded
        print("first recorded", stop_request.requested(), flush=True)
        os.kill(os.getpid(), {int(signum)})      # the second: exits here
        time.sleep(5)
        print("not reached", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 128 + signum, result.stderr
    assert f"first recorded {int(signum)}" in result.stdout
    assert "not reached" not in result.stdout
    name = signal.Signals(signum).name
    assert (f"second signal ({name}): exiting now; the last intact checkpoint is step 6 in "
            f"{tmp_path}") in result.stderr


def test_with_an_agreement_processes_stop_together_at_the_step_boundary(installed):
    """Several processes: a local check point passes (a process that stopped alone would leave
    its peers in a collective); the step boundary asks every process (here a stand-in for the
    collective) and stops where any was asked to."""
    asked = []

    def peers_say(signum):              # this process has no signal; a peer got SIGTERM
        asked.append(signum)
        return signum or int(signal.SIGTERM)

    stop_request.agree_with(peers_say)
    try:
        stop_request.check_stop()                       # passes: nothing local
        with pytest.raises(stop_request.StopRequested) as raised:
            stop_request.check_stop_at_step()
        assert asked == [0] and raised.value.signum == signal.SIGTERM
        assert stop_request.exit_status() == 143        # this process exits as its peer does
        # Its own first signal (a scheduler signals every host) is no second signal: it does
        # not exit at once while the agreed stop saves; the peer's signal stands.
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_request.exit_status() == 143
        stop_request.check_stop()                       # still passes
    finally:
        stop_request.agree_with(None)
    with pytest.raises(stop_request.StopRequested):    # alone again: the local check raises
        stop_request.check_stop()


def test_without_an_agreement_the_step_boundary_is_the_local_check(installed):
    stop_request.check_stop_at_step()
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(stop_request.StopRequested):
        stop_request.check_stop_at_step()
