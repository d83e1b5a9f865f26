"""A process that died, hung or failed ends the others within a bounded time: PeerWatchdog.

Every process writes a heartbeat counter into the coordination service's key-value store; process
0 watches every counter, the others watch process 0's counter and a verdict key that whoever
notices first writes. A counter that has not moved for the timeout, or a process that announced
a failure, ends every other process with `jrl.parallel: process <i> of <n> stopped responding
(last heartbeat <s> s ago): exiting` (or `... failed (<reason>): exiting`) and exit status
PEER_LOST_STATUS. An uncaught exception (e.g. a collective whose peer vanished, which fails at
once) first looks, for three heartbeat intervals, for a peer whose heartbeat stopped, so the
message names the process that died rather than the one that noticed; otherwise this process
announces its own failure and exits with status 1. Launchers call `finish(status)` at the end: 0
means done (no longer watched), anything else is announced as a failure. A dead process 0 takes
the coordination service with it: jax then aborts the others at once, with its own message.
jrl.parallel.distributed.initialize starts the watchdog.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, NamedTuple

import jax

# The exit status of a process ended because another one died, hung or failed (EX_TEMPFAIL: the
# job can be restarted with --resume).
PEER_LOST_STATUS = 75


def print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_ALIVE = "jrl/alive/"      # jrl/alive/<i>: process i's heartbeat counter, "done" or "failed (...)"
_VERDICT = "jrl/verdict"   # "<process>:<message>": why the job ends, from whoever noticed first
_ACK = "jrl/ack/"          # jrl/ack/<i>: process i has read the verdict and is exiting
_DONE = "done"
_FAILED = "failed"


class Verdict(NamedTuple):
    """Why this process must end: `process` is the one to blame, `message` says what happened
    (e.g. "process 1 of 2 stopped responding (last heartbeat 61 s ago)")."""

    process: int
    message: str


class KeyValueStore:
    """What PeerWatchdog needs of the coordination service's key-value store (jax's client)."""

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def add(self, key: str, value: str) -> bool:
        """Sets key only if it is absent; False when it was there already."""
        try:
            self._client.key_value_set(key, value, allow_overwrite=False)
        except Exception as err:   # jax raises its runtime error with the status in the text
            if "ALREADY_EXISTS" in str(err):
                return False
            raise
        return True

    def get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as err:
            if "NOT_FOUND" in str(err):
                return None
            raise

    def items(self, directory: str) -> dict[str, str]:
        return dict(self._client.key_value_dir_get(directory))


class PeerWatchdog:
    """Ends this process when another process of the job stopped responding or failed (see the
    module docstring). Process 0 watches every other process; the others watch process 0 and
    the verdict key, so the store serves O(processes) requests per interval.

    store: a KeyValueStore shared by all processes. timeout_s: a heartbeat counter unchanged for
    this long means its process is gone. interval_s: seconds between heartbeats (default
    timeout_s / 10, within [0.5, 5]). clock, sleep, exit and report are parameters so that tests
    can drive several watchdogs in one process.
    """

    def __init__(self, store, process_index: int, process_count: int, timeout_s: float, *,
                 interval_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 exit: Callable[[int], None] = os._exit,
                 report: Callable[[str], None] | None = None):
        self.store = store
        self.index, self.count = process_index, process_count
        self.timeout_s = float(timeout_s)
        self.interval_s = (interval_s if interval_s is not None
                           else min(5.0, max(0.5, self.timeout_s / 10)))
        self._clock, self._sleep, self._exit = clock, sleep, exit
        self._report = report or print_to_stderr
        self._beats = 0
        self._started = clock()
        # watched process -> (its last counter, local time when that counter first appeared):
        # ages are measured on this host's clock only, never compared across hosts.
        self._seen: dict[int, tuple[str | None, float]] = {
            j: (None, self._started) for j in self._watched()}
        self._finished: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _watched(self) -> list[int]:
        return [j for j in range(self.count) if j != self.index] if self.index == 0 else [0]

    # -- the heartbeat thread ------------------------------------------------------------------

    def start(self) -> None:
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="jrl-peer-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            verdict = self.tick()
            if verdict is not None:
                self.end(verdict)
                return

    def _beat(self) -> None:
        with self._lock:   # never after done() / fail() wrote this process's last word
            if self._closed:
                return
            self._beats += 1
            self.store.set(f"{_ALIVE}{self.index}", str(self._beats))

    def tick(self) -> Verdict | None:
        """One heartbeat and one look at the watched processes; the verdict when this process
        must end, else None."""
        now = self._clock()
        try:
            self._beat()
            posted = self.store.get(_VERDICT)
            if posted is not None:
                return _parse_verdict(posted)
            if self.index == 0:
                values = self.store.items(_ALIVE)
            else:
                values = {f"{_ALIVE}0": self.store.get(f"{_ALIVE}0")}
        except Exception:   # the service did not answer: no news from anyone this time
            values = {}
        for j in self._watched():
            verdict = self._observe(j, values.get(f"{_ALIVE}{j}"), now)
            if verdict is not None:
                return verdict
        return None

    def _observe(self, j: int, value: str | None, now: float) -> Verdict | None:
        """value: process j's heartbeat entry now (None: not written yet or no answer)."""
        if j in self._finished:
            return None
        if value == _DONE:
            self._finished.add(j)
            return None
        if value is not None and value.startswith(_FAILED):
            return Verdict(j, f"process {j} of {self.count} {value}")
        last, since = self._seen[j]
        if value is not None and value != last:
            self._seen[j] = (value, now)
            return None
        age = now - since
        if age > self.timeout_s:
            return Verdict(j, f"process {j} of {self.count} stopped responding (last heartbeat "
                              f"{age:.0f} s ago)")
        return None

    # -- how this process ends -------------------------------------------------------------------

    def end(self, verdict: Verdict, status: int = PEER_LOST_STATUS) -> None:
        """Says why, posts the verdict for the others (process 0 then waits until they have read
        it: its exit takes the coordination service down) and exits with `status`."""
        self._stop.set()
        self._report(f"jrl.parallel: {verdict.message}: exiting")
        try:
            self.store.add(_VERDICT, f"{verdict.process}:{verdict.message}")
            self.store.set(f"{_ACK}{self.index}", "1")
            if self.index == 0:
                self._wait_for_acks(exclude={verdict.process})
        except Exception:   # the others still have their own watchdogs and jax's heartbeat
            pass
        _flush()
        self._exit(status)

    def fail(self, reason: str, status: int) -> None:
        """This process fails (`reason`): announces it, so that the others end at their next
        look instead of waiting in a collective, and exits with `status`."""
        self._stop.set()
        self._report(f"jrl.parallel: process {self.index} of {self.count} {_FAILED} ({reason}): "
                     "exiting")
        with self._lock:
            self._closed = True
            try:
                self.store.set(f"{_ALIVE}{self.index}", f"{_FAILED} ({reason})")
                if self.index == 0:
                    self.store.add(_VERDICT, f"0:process 0 of {self.count} {_FAILED} ({reason})")
                    self._wait_for_acks(exclude={0})
            except Exception:
                pass
        _flush()
        self._exit(status)

    def done(self) -> None:
        """This process ends normally: the others stop watching it."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.store.set(f"{_ALIVE}{self.index}", _DONE)
            except Exception:
                pass

    def blame(self) -> Verdict | None:
        """After an error in this process: the peer that is likely its cause, else None. A
        collective whose peer died fails at once, long before that peer's heartbeat is
        `timeout_s` old; so look for a heartbeat that did not move over a few intervals (this
        process keeps beating meanwhile), or a peer that announced a failure."""
        window = min(3 * self.interval_s, self.timeout_s)
        try:
            before = self.store.items(_ALIVE)
            self._sleep(window)
            now = self._clock()
            posted = self.store.get(_VERDICT)
            if posted is not None:
                return _parse_verdict(posted)
            after = self.store.items(_ALIVE)
        except Exception:
            return None
        for j in range(self.count):
            value = after.get(f"{_ALIVE}{j}")
            if j == self.index or value == _DONE:
                continue
            if value is not None and value.startswith(_FAILED):
                return Verdict(j, f"process {j} of {self.count} {value}")
            if value == before.get(f"{_ALIVE}{j}"):
                since = self._seen[j][1] if j in self._seen else now - window
                return Verdict(j, f"process {j} of {self.count} stopped responding (last "
                                  f"heartbeat {now - since:.0f} s ago)")
        return None

    def _wait_for_acks(self, exclude: set[int]) -> None:
        """Until every other process has read the verdict, or is ending anyway (done, failed),
        for at most three heartbeat intervals (a process reads the verdict once per interval)."""
        waiting = {j for j in range(1, self.count) if j not in exclude}
        deadline = self._clock() + 3 * self.interval_s
        while waiting and self._clock() < deadline:
            acked = self.store.items(_ACK)
            alive = self.store.items(_ALIVE)
            waiting = {j for j in waiting if f"{_ACK}{j}" not in acked
                       and alive.get(f"{_ALIVE}{j}", "") != _DONE
                       and not alive.get(f"{_ALIVE}{j}", "").startswith(_FAILED)}
            if waiting:
                self._sleep(0.1)


def _parse_verdict(posted: str) -> Verdict:
    process, _, message = posted.partition(":")
    return Verdict(int(process), message)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


_watchdog: PeerWatchdog | None = None


def start_watchdog(timeout_s: int) -> None:
    """Starts the PeerWatchdog of this process (several processes only); an uncaught exception
    then ends the job with a message naming the process to blame."""
    global _watchdog
    from jax._src import distributed as jax_distributed
    state = jax_distributed.global_state
    client = getattr(state, "client", None)
    if _watchdog is not None or getattr(state, "num_processes", 1) < 2:
        return
    if client is None:
        print_to_stderr(f"jrl.parallel.initialize: jax {jax.__version__} keeps no distributed "
                        "client where jrl looks for it: the peer watchdog is off (jax's own "
                        "heartbeat still ends the job when a process dies)")
        return
    _watchdog = PeerWatchdog(KeyValueStore(client), state.process_id, state.num_processes,
                             timeout_s)
    _watchdog.start()
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        watchdog = _watchdog
        if watchdog is None or watchdog.closed:
            return
        if issubclass(exc_type, KeyboardInterrupt):
            watchdog.fail("interrupted", 130)
            return
        text = str(exc).strip().splitlines()
        reason = f"{exc_type.__name__}: {text[0] if text else ''}"[:200]
        verdict = watchdog.blame()
        if verdict is not None:
            watchdog.end(verdict)
        watchdog.fail(reason, 1)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _at_exit() -> None:
    if _watchdog is not None:
        _watchdog.done()


def finish(status: int) -> None:
    """Tells the other processes how this one ends (a no-op with one process). 0: done, they
    stop watching it. Otherwise failed: they exit at once with a message naming this process,
    and this process exits now with `status` (os._exit: jax's shutdown barrier would otherwise
    wait for processes that are already gone)."""
    if _watchdog is None:
        return
    if status == 0:
        _watchdog.done()
    else:
        _watchdog.fail(f"exit status {status}", status)
