"""Multi-process (multi-host) initialisation: one JAX process per host (TPU VM worker, GPU node
or, for tests, a local CPU process), all joined through a coordinator before any JAX computation.

Where the settings come from, first match wins:
  1. arguments of `initialize` (e.g. from the CLI flags of `add_arguments`);
  2. environment: JRL_COORDINATOR (host:port of process 0), JRL_NUM_PROCESSES, JRL_PROCESS_ID,
     optionally JRL_INIT_TIMEOUT_S, JRL_HEARTBEAT_TIMEOUT_S and JRL_CPU_DEVICES_PER_PROCESS
     (CPU only: forced host devices per process);
  3. JRL_COORDINATOR=auto, or nothing set on a Cloud TPU VM: jax.distributed.initialize() with
     no arguments, which reads the TPU (or SLURM / Open MPI) environment itself;
  4. nothing set: a single process; nothing to do.

jax.distributed.initialize aborts the whole process (a C++ fatal error, not an exception) when
the coordinator cannot be reached in time. So a non-coordinator process first waits for the
coordinator's port itself, and fails with a Python error naming the address and the timeout.

A process that dies, hangs or fails ends the others within a bounded time (`PeerWatchdog`, on
by default with several processes; JRL_HEARTBEAT_TIMEOUT_S / --heartbeat-timeout-s, default 60):
every process writes a heartbeat counter into the coordination service's key-value store; process
0 watches every counter, the others watch process 0's counter and a verdict key that whoever
notices first writes. A counter that has not moved for the timeout, or a process that announced
a failure, ends every other process with `jrl.parallel: process <i> of <n> stopped responding
(last heartbeat <s> s ago): exiting` (or `... failed (<reason>): exiting`) and exit status
PEER_LOST_STATUS. An uncaught exception (e.g. a collective whose peer vanished, which fails at
once) first looks, for three heartbeat intervals, for a peer whose heartbeat stopped, so the
message names the process that died rather than the one that noticed; otherwise this process
announces its own failure and exits with status 1. Launchers call `finish(status)` at the end: 0
means done (no longer watched), anything else is announced as a failure. jax's own coordination
heartbeat is set to twice the timeout as a backstop (it aborts with a C++ fatal error), and a dead
process 0 takes the coordination service with it: jax then aborts the others at once, with its
own message about the service's leader.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import os
import socket
import sys
import threading
import time
from typing import Callable, NamedTuple, Sequence

import jax

ENV_COORDINATOR = "JRL_COORDINATOR"
ENV_NUM_PROCESSES = "JRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JRL_PROCESS_ID"
ENV_CPU_DEVICES = "JRL_CPU_DEVICES_PER_PROCESS"
ENV_TIMEOUT = "JRL_INIT_TIMEOUT_S"
ENV_HEARTBEAT = "JRL_HEARTBEAT_TIMEOUT_S"
AUTO = "auto"
DEFAULT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
# The exit status of a process ended because another one died, hung or failed (EX_TEMPFAIL: the
# job can be restarted with --resume).
PEER_LOST_STATUS = 75

_DEVICES_FLAG = "--xla_force_host_platform_device_count"


class DistributedInfo(NamedTuple):
    """What `initialize` set up. mode: "single" (one process, nothing done), "explicit"
    (coordinator, count and id given) or "auto" (jax's own cluster detection)."""

    process_index: int
    process_count: int
    coordinator: str | None
    mode: str


class CoordinatorUnreachable(RuntimeError):
    """A process could not reach the coordinator within the timeout."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds --coordinator, --num-processes, --process-id, --init-timeout-s (defaults: env)."""
    group = parser.add_argument_group("multi-process (jrl.parallel.initialize)")
    group.add_argument("--coordinator", default=None,
                       help=f"host:port of process 0, or 'auto' (default ${ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, default=None,
                       help=f"number of processes (default ${ENV_NUM_PROCESSES})")
    group.add_argument("--process-id", type=int, default=None,
                       help=f"this process's index (default ${ENV_PROCESS_ID})")
    group.add_argument("--init-timeout-s", type=int, default=None,
                       help="seconds to wait for the coordinator and the other processes "
                            f"(default ${ENV_TIMEOUT} or {DEFAULT_TIMEOUT_S})")
    group.add_argument("--heartbeat-timeout-s", type=int, default=None,
                       help="a process whose heartbeat is this many seconds old is taken for "
                            "dead and the others exit (default "
                            f"${ENV_HEARTBEAT} or {DEFAULT_HEARTBEAT_TIMEOUT_S})")
    return parser


def initialize_from_args(args: argparse.Namespace) -> DistributedInfo:
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      timeout_s=args.init_timeout_s,
                      heartbeat_timeout_s=getattr(args, "heartbeat_timeout_s", None))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r}: must be an integer") from None


def _on_cloud_tpu_vm() -> bool:
    from jax._src.clusters import cloud_tpu_cluster
    return bool(getattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", False))


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r}: expected host:port, e.g. "
                         "10.0.0.1:8476")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float, *, interval_s: float = 0.2) -> None:
    """Returns once a TCP connection to `address` succeeds; raises CoordinatorUnreachable after
    timeout_s seconds."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 2.0)):
                return
        except OSError as error:
            last_error = error
        time.sleep(min(interval_s, max(deadline - time.monotonic(), 0)))
    raise CoordinatorUnreachable(
        f"jrl.parallel.initialize: could not reach the coordinator at {address} within "
        f"{timeout_s:g} s (last error: {last_error}). Check that process 0 is running and "
        f"listening there, that {host} resolves to process 0's host from this one, and that "
        f"port {port} is open between hosts.")


def _set_cpu_devices(count: int) -> None:
    """Forces `count` host devices (CPU platform); must run before JAX creates its backend."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICES_FLAG}={count}"])


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int | None = None,
               heartbeat_timeout_s: int | None = None,
               local_device_ids: int | Sequence[int] | None = None,
               cpu_devices_per_process: int | None = None) -> DistributedInfo:
    """Joins this process to the others (wraps jax.distributed.initialize); call it first,
    before anything that touches JAX devices. Returns a DistributedInfo.

    coordinator_address: "host:port" of process 0 (every process passes the same one), or
      "auto". num_processes / process_id: the count and this process's index (0 = coordinator).
    timeout_s: seconds to wait for the coordinator and for every process to register
      (default $JRL_INIT_TIMEOUT_S, else 300).
    heartbeat_timeout_s: a process silent for this long is taken for dead and every other
      process exits (PeerWatchdog; default $JRL_HEARTBEAT_TIMEOUT_S, else 60).
    local_device_ids: restrict this process to some local accelerators (GPU: one process per
      GPU). cpu_devices_per_process: CPU platform only, forced host devices per process.
    On CPU the collectives go through gloo (jax_cpu_collectives_implementation).
    """
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if cpu_devices_per_process is None:
        cpu_devices_per_process = _env_int(ENV_CPU_DEVICES)
    if timeout_s is None:
        timeout_s = _env_int(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S
    if heartbeat_timeout_s is None:
        heartbeat_timeout_s = _env_int(ENV_HEARTBEAT) or DEFAULT_HEARTBEAT_TIMEOUT_S
    for name, value in (("timeout_s", timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"initialize: {name}={value!r} must be a positive int (seconds)")
    if cpu_devices_per_process is not None:
        if cpu_devices_per_process <= 0:
            raise ValueError(f"cpu_devices_per_process={cpu_devices_per_process}: must be > 0")
        _set_cpu_devices(cpu_devices_per_process)

    if coordinator_address == AUTO or (coordinator_address is None and num_processes is None
                                       and process_id is None and _on_cloud_tpu_vm()):
        _print(f"jrl.parallel.initialize: cluster auto-detection (timeout {timeout_s} s)")
        jax.distributed.initialize(initialization_timeout=timeout_s,
                                   local_device_ids=local_device_ids,
                                   **_heartbeat_kwargs(heartbeat_timeout_s))
        _start_watchdog(heartbeat_timeout_s)
        return DistributedInfo(jax.process_index(), jax.process_count(), None, AUTO)

    given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    if all(v is None for v in given.values()):
        return DistributedInfo(0, 1, None, "single")
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"initialize: {missing} not set (got {given}); pass all of "
                         f"coordinator_address, num_processes, process_id (or ${ENV_COORDINATOR}, "
                         f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}), or none of them")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"initialize: num_processes={num_processes!r} must be an int >= 1")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"initialize: process_id={process_id!r} must be in [0, {num_processes})")
    _split_address(coordinator_address)
    if num_processes == 1:
        return DistributedInfo(0, 1, coordinator_address, "single")

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    started = time.monotonic()
    if process_id != 0:
        wait_for_coordinator(coordinator_address, timeout_s)
    remaining = max(1, int(round(timeout_s - (time.monotonic() - started))))
    # jax aborts the process when registration times out (e.g. another process never came):
    # say first, in our words, what was being waited for.
    watchdog = threading.Timer(remaining, _print, args=(
        f"jrl.parallel.initialize: process {process_id}/{num_processes} still not connected "
        f"after {timeout_s} s (coordinator {coordinator_address}); jax will abort. Did all "
        f"{num_processes} processes start with the same coordinator address?",))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   local_device_ids=local_device_ids,
                                   initialization_timeout=remaining,
                                   **_heartbeat_kwargs(heartbeat_timeout_s))
    finally:
        watchdog.cancel()
    _start_watchdog(heartbeat_timeout_s)
    return DistributedInfo(process_id, num_processes, coordinator_address, "explicit")


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0: the one that writes logs, metrics and non-array files."""
    return jax.process_index() == 0


def shutdown() -> None:
    """Leaves the distributed system (a no-op when it was never initialised)."""
    if _watchdog is not None:
        _watchdog.done()
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------------------------
# A process that died, hung or failed ends the others: PeerWatchdog

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
        self._report = report or _print
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


def _heartbeat_kwargs(timeout_s: int) -> dict:
    """jax's own coordination heartbeat: twice jrl's timeout, so that the watchdog (whose message
    names the process) acts first and jax's abort is the backstop."""
    if "heartbeat_timeout_seconds" not in inspect.signature(
            jax.distributed.initialize).parameters:
        _print(f"jrl.parallel.initialize: jax {jax.__version__}'s initialize takes no "
               "heartbeat_timeout_seconds; its coordination heartbeat keeps jax's default")
        return {}
    return {"heartbeat_timeout_seconds": 2 * timeout_s}


def _start_watchdog(timeout_s: int) -> None:
    """Starts the PeerWatchdog of this process (several processes only); an uncaught exception
    then ends the job with a message naming the process to blame."""
    global _watchdog
    from jax._src import distributed as jax_distributed
    state = jax_distributed.global_state
    client = getattr(state, "client", None)
    if _watchdog is not None or getattr(state, "num_processes", 1) < 2:
        return
    if client is None:
        _print(f"jrl.parallel.initialize: jax {jax.__version__} keeps no distributed client "
               "where jrl looks for it: the peer watchdog is off (jax's own heartbeat still ends "
               "the job when a process dies)")
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
