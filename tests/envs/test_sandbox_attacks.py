"""Attacks on the process sandbox (docs/sandbox.md's attack table): each one fails, the caller
(this test process) stays alive, and where a limit stops it, the limit says so.

The attacks that only the namespaces can stop are skipped (with the reason) where namespaces
cannot be set up. The code that could hurt the machine were its namespace missing (signals to
other processes) first checks that it runs as the first process of a PID namespace, and refuses
otherwise. The last tests pin what isolation="rlimits" does NOT isolate, as the docs say.
"""

import os
import pathlib
import socket
import subprocess
import threading

import pytest

from jrl.envs import ProcessLimits, ProcessSandbox
from tests.envs.sandbox_isolations import NAMESPACE_PROBLEM, needs_namespaces

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox() -> ProcessSandbox:
    return ProcessSandbox(ProcessLimits(timeout_s=10.0)) if NAMESPACE_PROBLEM is None else None


@pytest.fixture()
def listening_port():
    """A TCP server of this test process on 127.0.0.1 that answers "hello"."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(15)

    def answer():
        try:
            connection, _ = server.accept()
            connection.sendall(b"hello")
            connection.close()
        except OSError:
            pass
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


def _still_alive(sandbox: ProcessSandbox) -> None:
    assert subprocess.run(["true"]).returncode == 0
    assert sandbox.run_python("print('alive')").stdout == "alive\n"


@needs_namespaces
def test_network_is_unreachable(sandbox, listening_port):
    result = sandbox.run_python(
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {listening_port}), timeout=5)")
    assert result.error_line() == "OSError: [Errno 101] Network is unreachable", result
    dns = sandbox.run_python("import socket\nsocket.getaddrinfo('example.com', 443)")
    assert dns.error_line().startswith("socket.gaierror: [Errno -3]"), dns
    interfaces = sandbox.run_python("import socket\n[name for _, name in socket.if_nameindex()]")
    assert interfaces.stdout == "['lo']\n"       # loopback only, and it is down


@needs_namespaces
def test_fork_bomb_stops_at_the_process_limit(sandbox):
    limited = ProcessSandbox(ProcessLimits(processes=8, timeout_s=5.0))
    # Each level waits for its two copies: the forks fail at the limit and the failure unwinds.
    result = limited.run_shell("bomb() { bomb | bomb; }; bomb")
    assert result.limit_hit == "processes" and "Cannot fork" in result.stderr, result
    assert result.limit_message == "the process limit of 8 was hit (ProcessLimits.processes)"
    # The classic one backgrounds its copies and exits 0 at once: when its first process exits,
    # the kernel kills the rest of its PID namespace, copies and all.
    classic = limited.run_shell("bomb() { bomb | bomb & }; bomb")
    assert classic.limit_hit in (None, "processes") and classic.wall_s < 30, classic
    _still_alive(sandbox)


@needs_namespaces
def test_disk_filling_stops_at_the_scratch_size(sandbox):
    limited = ProcessSandbox(ProcessLimits(disk_bytes=8 * 2**20, file_size_bytes=2**30))
    result = limited.run_shell("cat /dev/zero > /tmp/fill")
    assert result.limit_hit == "disk" and "No space left on device" in result.stderr, result
    _still_alive(sandbox)


@needs_namespaces
def test_memory_exhaustion_stops_at_the_address_space_limit(sandbox):
    limited = ProcessSandbox(ProcessLimits(memory_bytes=128 * 2**20))
    result = limited.run_python("x = ' ' * 2**31")
    assert result.limit_hit == "memory", result
    _still_alive(sandbox)


@needs_namespaces
def test_infinite_loops_stop(sandbox):
    cpu = ProcessSandbox(ProcessLimits(cpu_s=1, timeout_s=60.0)).run_shell("while :; do :; done")
    assert cpu.limit_hit == "cpu", cpu
    wall = ProcessSandbox(ProcessLimits(timeout_s=1.0)).run_shell("sleep 60")
    assert wall.limit_hit == "timeout", wall
    _still_alive(sandbox)


@needs_namespaces
def test_host_files_are_hidden(sandbox):
    """The repository, /etc, /home, /proc and /sys are not in the sandbox's tree."""
    probes = [str(REPOSITORY / "pyproject.toml"), "/etc/passwd", "/etc/hostname", "/proc/1/environ",
              "/sys/kernel/hostname"]
    result = sandbox.run_python(
        "import os\n"
        f"for path in {probes!r}:\n"
        "    print(os.path.exists(path))\n"
        "print(sorted(os.listdir('/')))\n")
    lines = result.stdout.splitlines()
    assert lines[:len(probes)] == ["False"] * len(probes), result
    visible = set(eval(lines[-1]))          # noqa: S307 - our own program's printed list
    assert {"sandbox", "tmp", "usr", "dev"} <= visible
    assert not visible & {"home", "proc", "sys", "run", "var", "work", "mnt", "boot"}


@pytest.mark.parametrize("path", ["/escape_probe", "/usr/escape_probe", "/dev/escape_probe",
                                  "PREFIX/escape_probe", "REPOSITORY/escape_probe"])
@needs_namespaces
def test_writing_outside_the_scratch_directory_fails(sandbox, path):
    import sys
    path = path.replace("PREFIX", os.path.realpath(sys.base_prefix))
    path = path.replace("REPOSITORY", str(REPOSITORY))
    result = sandbox.run_python(f"open({path!r}, 'w').write('x')")
    assert result.exit_code == 1 and ("Read-only file system" in result.stderr or
                                      "No such file or directory" in result.stderr), result
    assert not os.path.exists(path)


@needs_namespaces
def test_privileges_cannot_be_regained(sandbox):
    """No capability, no new user namespace (the program is chrooted), no chroot, no mount."""
    result = sandbox.run_shell(
        "unshare --user --map-root-user true 2>&1 | tail -1; "
        "python3 -I -S -c 'import os\ntry:\n  os.chroot(\"/usr\")\nexcept OSError as e:\n"
        "  print(e.strerror)'; "
        "mount -t tmpfs none /tmp 2>&1 | head -1")
    lines = result.stdout.splitlines()
    assert lines[0] == "unshare: unshare failed: Operation not permitted", result
    assert lines[1] == "Operation not permitted"
    assert lines[2] == "mount: /tmp: must be superuser to use mount.", result


@needs_namespaces
def test_signals_do_not_reach_the_trainer(sandbox):
    """In its PID namespace the program is process 1 and its parent is 0: the trainer's pid names
    no process there, and kill(-1) reaches nothing outside."""
    trainer = os.getpid()
    result = sandbox.run_python(
        "import os, signal\n"
        "if os.getpid() != 1:\n"
        "    raise SystemExit('refusing: not in a PID namespace')\n"
        "print(os.getppid())\n"
        "for target, sig in ((%d, signal.SIGKILL), (%d, signal.SIGTERM)):\n"
        "    try:\n"
        "        os.kill(target, sig)\n"
        "    except OSError as error:\n"
        "        print(type(error).__name__)\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except OSError as error:\n"
        "    print(type(error).__name__)\n" % (trainer, os.getppid()))
    assert result.stdout.splitlines()[:3] == ["0", "ProcessLookupError", "ProcessLookupError"], \
        result
    assert os.getpid() == trainer
    _still_alive(sandbox)


@needs_namespaces
def test_leaving_the_process_group_does_not_outlive_the_wall_clock(sandbox):
    """setsid() takes the program out of the process group the wall clock kills; killing the PID
    namespace's first process still ends it."""
    limited = ProcessSandbox(ProcessLimits(timeout_s=1.0))
    result = limited.run_python("import os, time\nos.setsid()\ntime.sleep(60)")
    assert result.limit_hit == "timeout" and result.wall_s < 30, result
    orphan = limited.run_shell("(setsid sleep 60 &) ; echo started")
    # The first process exits at once; the namespace, and the orphan with it, go with it.
    assert orphan.stdout == "started\n" and orphan.limit_hit is None and orphan.wall_s < 30


@pytest.mark.skipif(os.geteuid() != 0, reason="the privileged setup runs only as root")
@needs_namespaces
def test_as_root_the_program_runs_as_nobody(sandbox):
    result = sandbox.run_python("import os\nos.getuid(), os.getgid(), os.getgroups()")
    assert result.stdout == "(65534, 65534, [])\n", result


# What isolation="rlimits" does not isolate (docs/sandbox.md): pinned so the docs stay true.
def test_rlimits_isolation_leaves_the_network_and_files_open(listening_port):
    rlimits = ProcessSandbox(isolation="rlimits")
    result = rlimits.run_python(
        "import socket\n"
        f"print(socket.create_connection(('127.0.0.1', {listening_port}), timeout=5).recv(5))\n"
        f"print(open({str(REPOSITORY / 'pyproject.toml')!r}).readline().strip())")
    assert result.stdout.splitlines() == ["b'hello'", "[build-system]"], result
    assert rlimits.run_python("import os\nos.getppid()").stdout == f"{os.getpid()}\n"
