"""jrl.parallel.initialize settings and errors; the local multi-process launcher."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from jrl.parallel import distributed
from launch import local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 3


@pytest.fixture
def clean_env(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                 distributed.ENV_PROCESS_ID, distributed.ENV_CPU_DEVICES):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_single_process_when_nothing_is_set(clean_env):
    info = distributed.initialize()
    assert info == distributed.DistributedInfo(0, 1, None, "single")
    assert distributed.initialize("127.0.0.1:1234", 1, 0).mode == "single"


def test_incomplete_or_bad_settings_are_named(clean_env):
    with pytest.raises(ValueError, match=r"\['num_processes'\] not set"):
        distributed.initialize("127.0.0.1:1234", None, 0)
    clean_env.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match=r"\['process_id'\] not set"):
        distributed.initialize()
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, 2\)"):
        distributed.initialize(process_id=2)
    with pytest.raises(ValueError, match=r"expected host:port"):
        distributed.initialize("no-port", 2, 1)
    clean_env.setenv(distributed.ENV_PROCESS_ID, "one")
    with pytest.raises(ValueError, match=r"\$JRL_PROCESS_ID='one': must be an integer"):
        distributed.initialize()


def test_unreachable_coordinator_fails_clearly_within_the_timeout():
    """A process pointed at a port nobody listens on raises a Python error naming the address
    and the timeout after the timeout (jax itself would abort the process)."""
    port = local_cluster.free_port()
    code = textwrap.dedent(f"""
        import sys, time
        from jrl.parallel import distributed
        start = time.monotonic()
        try:
            distributed.initialize("127.0.0.1:{port}", 2, 1, timeout_s={TIMEOUT_S})
        finally:
            print(f"elapsed {{time.monotonic() - start:.3f}}", file=sys.stderr)
    """)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=TIMEOUT_S + 60)
    wall = time.monotonic() - start
    assert result.returncode != 0
    assert "CoordinatorUnreachable" in result.stderr
    assert (f"could not reach the coordinator at 127.0.0.1:{port} within {TIMEOUT_S} s"
            in result.stderr), result.stderr[-2000:]
    elapsed = float(result.stderr.rsplit("elapsed ", 1)[1].split()[0])
    assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + 1.5, elapsed
    assert wall < TIMEOUT_S + 30, wall


# ------------------------------------------------------------------------------------------------
# launch/local_cluster.py

def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_local_cluster_sets_env_and_prefixes_output():
    out = io.StringIO()
    status = local_cluster.run(_python("""
        import os
        print(os.environ["JRL_PROCESS_ID"], os.environ["JRL_NUM_PROCESSES"],
              os.environ["JRL_COORDINATOR"], os.environ["XLA_FLAGS"])
    """), processes=3, devices_per_process=2, timeout_s=60, out=out)
    assert status == 0
    lines = sorted(out.getvalue().splitlines())
    assert [line[:4] for line in lines] == ["[p0]", "[p1]", "[p2]"]
    coordinators = set()
    for i, line in enumerate(lines):
        _, pid, count, coordinator, *flags = line.split()
        assert (pid, count) == (str(i), "3")
        assert "--xla_force_host_platform_device_count=2" in flags
        coordinators.add(coordinator)
    assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")


def test_local_cluster_propagates_the_first_failure_and_ends_the_others():
    out = io.StringIO()
    start = time.monotonic()
    status = local_cluster.run(_python("""
        import os, sys, time
        if os.environ["JRL_PROCESS_ID"] == "1":
            print("failing", flush=True)
            sys.exit(3)
        time.sleep(120)
    """), processes=2, timeout_s=60, out=out)
    assert status == 3
    assert time.monotonic() - start < 20
    assert "[p1] failing" in out.getvalue()
    assert "process 1 exited with status 3; ending the others" in out.getvalue()


def test_local_cluster_timeout():
    out = io.StringIO()
    status = local_cluster.run(_python("import time; time.sleep(120)"), processes=2,
                               timeout_s=1, out=out)
    assert status == local_cluster.TIMEOUT_STATUS
    assert "timeout after 1 s" in out.getvalue()


def test_local_cluster_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit):
        local_cluster.main(["--processes", "2"])
    assert "no command given" in capsys.readouterr().err
