"""Runs one command as N CPU processes on this machine, joined like hosts of a cluster.

    jrl local-cluster --processes 2 --devices-per-process 2 -- \
        python -m launch.parallel_selftest train --out /tmp/params.npz

Each process gets JRL_COORDINATOR=127.0.0.1:<free port>, JRL_NUM_PROCESSES, JRL_PROCESS_ID,
JRL_CPU_DEVICES_PER_PROCESS, JAX_PLATFORMS=cpu and XLA_FLAGS with the forced device count, so
`jrl.parallel.initialize()` in the command joins them (collectives over gloo). Output lines are
prefixed with [pN]. The first process to fail (nonzero status, or killed by a signal) ends the
others with a line naming it, and its exit status is returned (128 + N for signal N);
--timeout-s ends all of them and returns 124. `start` only starts the processes, for callers
that watch them themselves (the tests of what the processes do when one of them dies).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
TIMEOUT_STATUS = 124


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(base: dict, *, coordinator: str, num_processes: int, process_id: int,
                devices_per_process: int) -> dict:
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICES_FLAG)]
    env.update({
        "JRL_COORDINATOR": coordinator,
        "JRL_NUM_PROCESSES": str(num_processes),
        "JRL_PROCESS_ID": str(process_id),
        "JRL_CPU_DEVICES_PER_PROCESS": str(devices_per_process),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags + [f"{_DEVICES_FLAG}={devices_per_process}"]),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def _end(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM to each still-running child's process group, then SIGKILL after grace_s."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def describe_exit(returncode: int) -> tuple[str, int]:
    """("exited with status 3" | "was killed by SIGKILL", the shell's status: 128 + N for a
    signal N) for a Popen returncode (negative: killed by a signal)."""
    if returncode >= 0:
        return f"exited with status {returncode}", returncode
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}", 128 - returncode


def start(command: list[str], *, processes: int, devices_per_process: int = 1,
          port: int | None = None, env: dict | None = None,
          outputs: list | None = None) -> list[subprocess.Popen]:
    """Starts `command` as `processes` joined CPU processes, each in its own process group.
    outputs: one writable file per process for its stdout and stderr (default: a pipe each)."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError(f"local_cluster: --processes={processes} and --devices-per-process="
                         f"{devices_per_process} must be >= 1")
    if not command:
        raise ValueError("local_cluster: no command given (put it after --)")
    if outputs is not None and len(outputs) != processes:
        raise ValueError(f"local_cluster: {len(outputs)} outputs for {processes} processes")
    coordinator = f"127.0.0.1:{port or free_port()}"
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    try:
        for process_id in range(processes):
            procs.append(subprocess.Popen(
                command, stdout=subprocess.PIPE if outputs is None else outputs[process_id],
                stderr=subprocess.STDOUT,
                env=process_env(base, coordinator=coordinator, num_processes=processes,
                                process_id=process_id, devices_per_process=devices_per_process),
                start_new_session=True))  # its own process group: ended with its children
    except BaseException:
        _end(procs)
        raise
    return procs


def run(command: list[str], *, processes: int, devices_per_process: int = 1,
        timeout_s: float | None = None, port: int | None = None, out=None,
        env: dict | None = None) -> int:
    """Starts `command` as `processes` joined CPU processes; returns the exit status (0 if all
    succeeded, else the first failure's status (128 + N when killed by signal N), or 124 on
    timeout)."""
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        procs = start(command, processes=processes, devices_per_process=devices_per_process,
                      port=port, env=env)
        for process_id, proc in enumerate(procs):
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{process_id}] ", out,
                                                        lock), daemon=True)
            pump.start()
            pumps.append(pump)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        status = 0
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                process_id, returncode = failed[0]
                how, status = describe_exit(returncode)
                with lock:
                    out.write(f"[local_cluster] process {process_id} of {processes} {how}; "
                              "ending the others\n")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                status = TIMEOUT_STATUS
                with lock:
                    out.write(f"[local_cluster] timeout after {timeout_s:g} s; ending all "
                              "processes\n")
                break
            time.sleep(0.05)
    finally:
        _end(procs)
        for pump in pumps:
            pump.join(timeout=5)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="jrl local-cluster",
        description="Run a command as N joined CPU processes (see module docstring).",
        usage="%(prog)s --processes N [--devices-per-process D] [--timeout-s S] -- CMD ...")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port (default: a free one)")
    args = parser.parse_args(own)
    if not command:
        parser.error("no command given: put it after --")
    return run(command, processes=args.processes, devices_per_process=args.devices_per_process,
               timeout_s=args.timeout_s, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
