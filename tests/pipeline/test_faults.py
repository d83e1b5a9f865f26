"""jrl.pipeline.loop.faults.interrupts_deferred: Ctrl-C inside the block arrives when it ends."""

import os
import signal

import pytest

from jrl.pipeline.loop.faults import interrupts_deferred


def test_an_interrupt_inside_the_block_is_raised_when_it_ends():
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append("after the signal")     # not cut short
    assert finished == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # handler restored


def test_without_an_interrupt_the_block_runs_as_usual():
    with interrupts_deferred():
        value = 1 + 1
    assert value == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
