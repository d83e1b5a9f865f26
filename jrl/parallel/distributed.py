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

A process that dies, hangs or fails ends the others within a bounded time: initialize starts the
PeerWatchdog of jrl.parallel.watchdog (JRL_HEARTBEAT_TIMEOUT_S / --heartbeat-timeout-s, default
60), and jax's own coordination heartbeat is set to twice that timeout as a backstop.
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import threading
import time
from typing import NamedTuple, Sequence

import jax

# PEER_LOST_STATUS and finish are part of this module's interface (launchers use them).
from jrl.parallel.watchdog import (PEER_LOST_STATUS, finish,  # noqa: F401
                                  print_to_stderr, start_watchdog)

ENV_COORDINATOR = "JRL_COORDINATOR"
ENV_NUM_PROCESSES = "JRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JRL_PROCESS_ID"
ENV_CPU_DEVICES = "JRL_CPU_DEVICES_PER_PROCESS"
ENV_TIMEOUT = "JRL_INIT_TIMEOUT_S"
ENV_HEARTBEAT = "JRL_HEARTBEAT_TIMEOUT_S"
AUTO = "auto"
DEFAULT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 60

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
        print_to_stderr(f"jrl.parallel.initialize: cluster auto-detection (timeout {timeout_s} s)")
        jax.distributed.initialize(initialization_timeout=timeout_s,
                                   local_device_ids=local_device_ids,
                                   **_heartbeat_kwargs(heartbeat_timeout_s))
        start_watchdog(heartbeat_timeout_s)
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
    watchdog = threading.Timer(remaining, print_to_stderr, args=(
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
    start_watchdog(heartbeat_timeout_s)
    return DistributedInfo(process_id, num_processes, coordinator_address, "explicit")


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0: the one that writes logs, metrics and non-array files."""
    return jax.process_index() == 0


def shutdown() -> None:
    """Leaves the distributed system (a no-op when it was never initialised)."""
    finish(0)
    jax.distributed.shutdown()


def _heartbeat_kwargs(timeout_s: int) -> dict:
    """jax's own coordination heartbeat: twice jrl's timeout, so that the watchdog (whose message
    names the process) acts first and jax's abort is the backstop."""
    if "heartbeat_timeout_seconds" not in inspect.signature(
            jax.distributed.initialize).parameters:
        print_to_stderr(f"jrl.parallel.initialize: jax {jax.__version__}'s initialize takes no "
               "heartbeat_timeout_seconds; its coordination heartbeat keeps jax's default")
        return {}
    return {"heartbeat_timeout_seconds": 2 * timeout_s}
