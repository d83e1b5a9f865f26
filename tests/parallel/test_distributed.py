"""jrl.parallel.initialize settings and errors; the local multi-process launcher."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

from jrl.parallel import distributed, watchdog
from jrl.cli import local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 3


@pytest.fixture
def clean_env(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                 distributed.ENV_PROCESS_ID, distributed.ENV_CPU_DEVICES,
                 distributed.ENV_HEARTBEAT):
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
# jrl/cli/local_cluster.py

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
    assert "process 1 of 2 exited with status 3; ending the others" in out.getvalue()


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


# ------------------------------------------------------------------------------------------------
# PeerWatchdog: several processes' watchdogs in one test, over one in-memory store and one clock

class FakeStore:
    """The key-value store's interface (watchdog.KeyValueStore) over a dict."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.broken = False

    def _check(self):
        if self.broken:
            raise RuntimeError("UNAVAILABLE: coordination service unreachable")

    def set(self, key, value):
        self._check()
        self.data[key] = value

    def add(self, key, value):
        self._check()
        if key in self.data:
            return False
        self.data[key] = value
        return True

    def get(self, key):
        self._check()
        return self.data.get(key)

    def items(self, directory):
        self._check()
        return {k: v for k, v in self.data.items() if k.startswith(directory)}


class Exited(Exception):
    def __init__(self, status):
        super().__init__(status)
        self.status = status


class FakeCluster:
    """`count` watchdogs (timeout 10 s, a heartbeat per second); `live` is who still ticks."""

    def __init__(self, count: int, timeout_s: float = 10.0):
        self.store = FakeStore()
        self.now = 0.0
        self.reports: list[tuple[int, str]] = []
        self.live = set(range(count))
        self.dogs = [watchdog.PeerWatchdog(
            self.store, i, count, timeout_s, interval_s=1.0, clock=lambda: self.now,
            sleep=self._sleep, exit=self._exit,
            report=lambda message, i=i: self.reports.append((i, message)))
            for i in range(count)]
        for i in range(count):
            self.dogs[i]._beat()

    @staticmethod
    def _exit(status):
        raise Exited(status)

    def _sleep(self, seconds: float) -> None:
        # Time passes; the live processes' heartbeat threads keep beating meanwhile.
        end = self.now + seconds
        while self.now + 1.0 <= end:
            self.now += 1.0
            for i in sorted(self.live):
                self.dogs[i]._beat()
        self.now = end

    def tick_all(self) -> dict[int, watchdog.Verdict]:
        """One interval: every live watchdog ticks; returns the verdicts."""
        self.now += 1.0
        verdicts = {i: self.dogs[i].tick() for i in sorted(self.live)}
        return {i: v for i, v in verdicts.items() if v is not None}


def test_watchdog_quiet_while_everyone_beats():
    cluster = FakeCluster(3)
    for _ in range(60):
        assert cluster.tick_all() == {}


def test_watchdog_names_a_silent_process_after_the_timeout_and_tells_the_others():
    cluster = FakeCluster(3)
    for _ in range(5):
        assert cluster.tick_all() == {}
    cluster.live.discard(2)                       # process 2 dies (SIGKILL): no more heartbeats
    seconds = 0
    while not (verdicts := cluster.tick_all()):
        seconds += 1
    # Process 0 watches everyone. It read 2's last counter (written at t=5) at t=6, so the
    # counter is older than 10 s at t=17: 11 quiet ticks (t=6..16), then the verdict.
    assert seconds == 11 and list(verdicts) == [0]
    assert verdicts[0] == watchdog.Verdict(
        2, "process 2 of 3 stopped responding (last heartbeat 11 s ago)")
    with pytest.raises(Exited) as exited:
        cluster.dogs[0].end(verdicts[0])
    assert exited.value.status == distributed.PEER_LOST_STATUS
    assert cluster.reports == [
        (0, "jrl.parallel: process 2 of 3 stopped responding (last heartbeat 11 s ago): exiting")]
    # Process 1 only watches process 0 and the verdict: it ends with the same message.
    cluster.live.discard(0)
    assert cluster.tick_all() == {1: verdicts[0]}


def test_watchdog_other_processes_notice_a_silent_process_0():
    cluster = FakeCluster(2)
    cluster.live.discard(0)
    # 0's only counter (written at t=0) is first read at t=1 and is older than 10 s at t=12.
    verdicts = [cluster.tick_all() for _ in range(12)]
    assert verdicts[:11] == [{}] * 11
    assert verdicts[11] == {1: watchdog.Verdict(
        0, "process 0 of 2 stopped responding (last heartbeat 11 s ago)")}


def test_watchdog_unreachable_store_counts_as_silence_not_as_failure():
    cluster = FakeCluster(2)
    cluster.store.broken = True
    cluster.live.discard(0)
    verdicts = []
    for _ in range(11):   # no answer since t=0: too old at t=11
        cluster.now += 1.0
        verdicts.append(cluster.dogs[1].tick())
    assert verdicts[:10] == [None] * 10
    assert verdicts[10] == watchdog.Verdict(
        0, "process 0 of 2 stopped responding (last heartbeat 11 s ago)")


def test_watchdog_failure_is_announced_and_ends_the_others_at_once():
    cluster = FakeCluster(2)
    cluster.tick_all()
    with pytest.raises(Exited) as exited:
        cluster.dogs[1].fail("RuntimeError: boom", 1)
    assert exited.value.status == 1
    cluster.live.discard(1)
    assert cluster.tick_all() == {0: watchdog.Verdict(
        1, "process 1 of 2 failed (RuntimeError: boom)")}
    # A failing process 0 posts the verdict itself (its exit takes the service down).
    cluster = FakeCluster(2)
    with pytest.raises(Exited):
        cluster.dogs[0].fail("exit status 2", 2)
    cluster.live.discard(0)
    assert cluster.tick_all() == {1: watchdog.Verdict(
        0, "process 0 of 2 failed (exit status 2)")}


def test_watchdog_a_finished_process_is_no_longer_watched():
    cluster = FakeCluster(2)
    cluster.dogs[1].done()
    cluster.live.discard(1)
    cluster.dogs[1]._beat()                       # a late beat never overwrites "done"
    assert cluster.store.data["jrl/alive/1"] == "done"
    for _ in range(30):
        assert cluster.tick_all() == {}


def test_watchdog_blame_after_an_error_names_the_peer_whose_heartbeat_stopped():
    """A collective fails at once when its peer dies; the process that caught the error looks
    for the silent peer over three heartbeat intervals instead of blaming itself."""
    cluster = FakeCluster(3)
    for _ in range(5):
        cluster.tick_all()
    cluster.live.discard(2)
    verdict = cluster.dogs[1].blame()
    assert verdict.process == 2
    assert verdict.message.startswith("process 2 of 3 stopped responding (last heartbeat")
    # Everyone alive: nobody else to blame.
    cluster = FakeCluster(3)
    assert cluster.dogs[1].blame() is None


def test_initialize_rejects_a_bad_heartbeat_timeout(clean_env):
    with pytest.raises(ValueError, match=r"heartbeat_timeout_s=0 must be a positive int"):
        distributed.initialize("127.0.0.1:1234", 2, 1, heartbeat_timeout_s=0)


def test_finish_is_a_no_op_with_one_process():
    assert watchdog._watchdog is None
    distributed.finish(0)
    distributed.finish(3)   # would exit with several processes


def test_local_cluster_names_a_process_killed_by_a_signal():
    out = io.StringIO()
    status = local_cluster.run(_python("""
        import os, signal, time
        if os.environ["JRL_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """), processes=2, timeout_s=60, out=out)
    assert status == 128 + 9
    assert "process 1 of 2 was killed by SIGKILL; ending the others" in out.getvalue()
