"""jrl.envs.process_sandbox: running, files, output, each limit as a feature (the limit hit, its
message, the caller alive), and the pool. The attacks are in test_sandbox_attacks.py."""

import dataclasses
import subprocess

import pytest

from jrl.envs import (
    LIMITS_HIT,
    ProcessLimits,
    ProcessResult,
    ProcessSandbox,
    SandboxPool,
    SandboxUnavailable,
)
from jrl.envs.process_sandbox import LIMIT_FIELDS, limit_message
from tests.envs.sandbox_isolations import BOTH, needs_namespaces


def _sandbox(isolation: str, **limits) -> ProcessSandbox:
    return ProcessSandbox(ProcessLimits(**limits), isolation=isolation)


def _assert_limit(result: ProcessResult, limit: str) -> None:
    """The limit was hit and said so, naming its ProcessLimits field."""
    assert result.limit_hit == limit, result
    assert f"(ProcessLimits.{LIMIT_FIELDS[limit]})" in result.limit_message
    assert result.error_line() == result.limit_message
    assert not result.ok


def _assert_caller_alive(sandbox: ProcessSandbox) -> None:
    """The test process still forks, and the sandbox still runs programs."""
    assert subprocess.run(["true"]).returncode == 0
    assert sandbox.run_python("print(6 * 7)").stdout == "42\n"


@pytest.mark.parametrize("field, value", [
    ("timeout_s", 0), ("timeout_s", float("inf")), ("timeout_s", True), ("cpu_s", 0),
    ("memory_bytes", 1024), ("processes", 0), ("file_size_bytes", 1.5), ("open_files", 3),
    ("disk_bytes", 10), ("output_bytes", 0),
])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=f"ProcessLimits: {field}={value!r} is not allowed"):
        ProcessLimits(**{field: value})


def test_options_are_validated():
    with pytest.raises(ValueError, match="isolation='docker' is not allowed; allowed: "
                                         r"\('namespaces', 'rlimits'\)"):
        ProcessSandbox(isolation="docker")
    with pytest.raises(ValueError, match="limits=3 is not allowed"):
        ProcessSandbox(3)
    with pytest.raises(ValueError, match="workers=0 is not allowed"):
        SandboxPool(ProcessSandbox(isolation="rlimits"), workers=0)
    for name in ("../x.py", "/etc/x", "", "a/./b", "a//b"):
        with pytest.raises(ValueError, match="file name .* is not allowed"):
            ProcessSandbox(isolation="rlimits").run_python("1", files={name: "x"})


def test_every_limit_has_a_message():
    limits = ProcessLimits()
    assert set(LIMITS_HIT) == set(LIMIT_FIELDS)
    assert limit_message("timeout", limits) == \
        "the wall-clock limit of 3.0 s was hit (ProcessLimits.timeout_s)"
    for limit in LIMITS_HIT:
        assert f"ProcessLimits.{LIMIT_FIELDS[limit]}" in limit_message(limit, limits)


@pytest.mark.parametrize("isolation", BOTH)
def test_runs_real_python_with_imports(isolation):
    result = _sandbox(isolation).run_python(
        "import json, math\nprint(json.dumps({'f': math.factorial(5)}))\n'done'")
    # The last bare expression's repr follows the printed text, as a REPL shows it.
    assert result == dataclasses.replace(result, exit_code=0, stdout='{"f": 120}\n\'done\'\n',
                                         stderr="", limit_hit=None)
    assert result.ok and result.wall_s > 0 and result.cpu_s > 0


@pytest.mark.parametrize("isolation", BOTH)
def test_files_are_in_the_working_directory_and_importable(isolation):
    files = {"pkg/values.py": "VALUE = 41\n", "data.txt": b"bytes\n"}
    result = _sandbox(isolation).run_python(
        "from pkg.values import VALUE\nprint(VALUE + 1, open('data.txt').read().strip())", files)
    assert result.stdout == "42 bytes\n", result


@pytest.mark.parametrize("isolation", BOTH)
def test_runs_shell_commands_with_exit_status_and_stderr(isolation):
    result = _sandbox(isolation).run_shell("cat in.txt; echo err >&2; exit 3",
                                           files={"in.txt": "out\n"})
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert result.limit_hit is None and not result.ok
    assert result.error_line() == "err"


@pytest.mark.parametrize("isolation", BOTH)
def test_shell_finds_the_trainers_python(isolation):
    result = _sandbox(isolation).run_shell(
        "python3 -I -S -c 'import sys; print(sys.version_info[0])'")
    assert result.stdout == "3\n", result


@pytest.mark.parametrize("isolation", BOTH)
def test_program_errors_are_reported_not_raised(isolation):
    result = _sandbox(isolation).run_python("print('before')\n1 / 0")
    assert result.exit_code == 1 and result.limit_hit is None and result.stdout == "before\n"
    assert result.error_line() == "ZeroDivisionError: division by zero"
    syntax = _sandbox(isolation).run_python("if True\n    pass")
    assert syntax.error_line() == "SyntaxError: expected ':'"


@pytest.mark.parametrize("isolation", BOTH)
def test_output_is_cut_at_output_bytes(isolation):
    result = _sandbox(isolation, output_bytes=1000).run_python(
        "import sys\nprint('x' * 5000)\nsys.stderr.write('e' * 3000)")
    assert result.stdout == "x" * 1000 and result.stderr == "e" * 1000
    assert result.stdout_truncated and result.stderr_truncated and result.ok
    small = _sandbox(isolation, output_bytes=1000).run_python("print('x' * 999)")
    assert small.stdout == "x" * 999 + "\n" and not small.stdout_truncated


@pytest.mark.parametrize("isolation", BOTH)
def test_nothing_of_the_trainers_environment_passes(isolation, monkeypatch):
    monkeypatch.setenv("JRL_SANDBOX_TEST_SECRET", "s3cret")
    result = _sandbox(isolation).run_shell('echo "[$JRL_SANDBOX_TEST_SECRET]"; echo "$HOME"; pwd')
    secret, home, cwd = result.stdout.splitlines()
    assert secret == "[]" and home == cwd
    if isolation == "namespaces":
        assert cwd == "/sandbox"


@pytest.mark.parametrize("isolation", BOTH)
def test_each_run_starts_from_an_empty_scratch_directory(isolation):
    sandbox = _sandbox(isolation)
    assert sandbox.run_shell("echo 1 > left.txt; ls").stdout == "left.txt\n"
    assert sandbox.run_shell("ls").stdout == ""


@pytest.mark.parametrize("isolation", BOTH)
def test_wall_clock_limit(isolation):
    sandbox = _sandbox(isolation, timeout_s=1.0)
    result = sandbox.run_python("import time\nprint('started', flush=True)\ntime.sleep(60)")
    _assert_limit(result, "timeout")
    assert result.exit_code == -9 and result.stdout == "started\n"
    assert result.limit_message == "the wall-clock limit of 1.0 s was hit " \
                                   "(ProcessLimits.timeout_s)"
    assert result.wall_s < 30      # killed, not slept out
    _assert_caller_alive(sandbox)


@pytest.mark.parametrize("isolation", BOTH)
def test_cpu_limit(isolation):
    # A wall clock far above the CPU limit, so that the kernel's CPU limit ends the loop even on
    # a loaded machine.
    sandbox = _sandbox(isolation, cpu_s=1, timeout_s=60.0)
    result = sandbox.run_python("while True:\n    pass")
    _assert_limit(result, "cpu")
    assert result.exit_code == -9 and result.cpu_s >= 0.5
    assert result.limit_message == "the CPU time limit of 1 s was hit (ProcessLimits.cpu_s)"
    _assert_caller_alive(sandbox)


@pytest.mark.parametrize("isolation", BOTH)
def test_memory_limit(isolation):
    sandbox = _sandbox(isolation, memory_bytes=256 * 2**20)
    result = sandbox.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))")
    _assert_limit(result, "memory")
    assert result.error_line() == \
        "the memory limit of 268435456 bytes was hit (ProcessLimits.memory_bytes)"
    assert result.stderr.rstrip().endswith("MemoryError")
    _assert_caller_alive(sandbox)


@pytest.mark.parametrize("isolation", BOTH)
def test_file_size_limit(isolation):
    sandbox = _sandbox(isolation, file_size_bytes=2**20)
    result = sandbox.run_python("open('big', 'wb').write(b'x' * 2**21)")
    _assert_limit(result, "file_size")
    assert "File too large" in result.stderr
    shell = sandbox.run_shell("head -c 2097152 /dev/zero > big")
    _assert_limit(shell, "file_size")
    _assert_caller_alive(sandbox)


@needs_namespaces
def test_process_limit():
    sandbox = _sandbox("namespaces", processes=8)
    result = sandbox.run_python(
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "finally:\n"
        "    print(children)\n")
    _assert_limit(result, "processes")
    # At most 7 children beside the program itself; the sleeping children died with it.
    assert 0 < int(result.stdout) <= 7 and "BlockingIOError" in result.stderr
    assert result.wall_s < 25
    _assert_caller_alive(sandbox)


@needs_namespaces
def test_disk_limit():
    sandbox = _sandbox("namespaces", disk_bytes=4 * 2**20, file_size_bytes=2**20)
    result = sandbox.run_python(
        "for index in range(100):\n"
        "    with open(f'part{index}', 'wb') as f:\n"
        "        f.write(b'x' * 2**20)\n")
    _assert_limit(result, "disk")
    assert "No space left on device" in result.stderr
    _assert_caller_alive(sandbox)


def test_unavailable_namespaces_are_refused_with_the_reason(monkeypatch):
    from jrl.envs import process_sandbox
    monkeypatch.setattr(process_sandbox, "namespace_problem",
                        lambda: "the process sandbox's isolation='namespaces' is not available "
                                "here: unshare failed. Or pass isolation='rlimits' ...")
    with pytest.raises(SandboxUnavailable, match="isolation='namespaces' is not available "
                                                 "here: unshare failed"):
        ProcessSandbox()
    assert ProcessSandbox(isolation="rlimits").isolation == "rlimits"


@pytest.mark.parametrize("isolation", BOTH)
def test_pool_runs_sandboxes_at_once(isolation):
    """Four runs that each sleep 2 s on a pool of four: every run starts before any ends (each
    prints its start and end time; all share the host's clock), so they overlapped. Sequential
    runs could not: the first would end before the last began."""
    workers = 4
    source = ("import time\nstart = time.time()\ntime.sleep(2.0)\n"
              "print(start, time.time())")
    with SandboxPool(_sandbox(isolation, timeout_s=60.0), workers=workers) as pool:
        results = pool.run_python([source] * workers)
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    assert len(intervals) == workers and all(r.ok for r in results)
    assert max(start for start, _ in intervals) < min(end for _, end in intervals), intervals


def test_pool_keeps_the_order_of_its_inputs():
    with SandboxPool(ProcessSandbox(isolation="rlimits"), workers=2) as pool:
        results = pool.run_python([f"print({i})" for i in range(5)])
        shell = pool.submit_shell("echo shell").result()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
    assert shell.stdout == "shell\n"
