"""Two processes x two CPU devices, joined through jrl.cli.local_cluster: training is bitwise
equal to one process with four devices, and Orbax checkpoints move between the two layouts."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from jrl import parallel
from launch.parallel_selftest import flatten, tiny_setup
from jrl.train.checkpoint import Checkpointer
from jrl.cli import local_cluster

from .helpers import STEPS, bitwise_differences, devices, run_parallel

pytestmark = pytest.mark.slow

MESH = (1, 4, 1)


def launch_selftest(*args: str, processes: int = 2, devices_per_process: int = 2) -> str:
    out = io.StringIO()
    status = local_cluster.run(
        [sys.executable, "-m", "launch.parallel_selftest", *args], processes=processes,
        devices_per_process=devices_per_process, timeout_s=400, out=out)
    assert status == 0, out.getvalue()[-5000:]
    return out.getvalue()


def load(path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """2 steps with fsdp=4 over 2 processes x 2 devices; the final state saved to Orbax."""
    tmp = tmp_path_factory.mktemp("two_processes")
    log = launch_selftest("--mesh", ",".join(map(str, MESH)), "--steps", str(STEPS),
                          "--out", str(tmp / "two.npz"), "--save-ckpt", str(tmp / "ckpt"))
    assert "process 1/2 (explicit): 2 local of 4 devices" in log
    return tmp, load(tmp / "two.npz")


def test_two_processes_equal_one_process_bitwise(two_process_run):
    _, two = two_process_run
    assert bitwise_differences(run_parallel(MESH), two) == []


def _state_only(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if not k.startswith("metrics")}


def test_checkpoint_saved_by_two_processes_restores_in_one_and_back(two_process_run, tmp_path):
    tmp, two = two_process_run
    config, _, _, _, host_state, _ = tiny_setup()
    # 2 processes -> 1 process, onto another mesh (data=2 x fsdp=2).
    mesh = parallel.make_mesh(parallel.MeshConfig(2, 2, 1), devices(4))
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    checkpointer = Checkpointer(str(tmp / "ckpt"))
    restored, _, meta = checkpointer.restore(parallel.host_to_global(host_state, shardings))
    checkpointer.close()
    assert meta == {"saved_by_processes": 2}
    assert restored.params["layers"]["wq"].sharding == shardings.params["layers"]["wq"]
    assert bitwise_differences(flatten(parallel.global_to_host(restored)), _state_only(two)) == []

    # 1 process -> 2 processes: save it here, restore there (0 steps) and write it back out.
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(STEPS, restored, {"saved_by_processes": 1})
    checkpointer.close()
    log = launch_selftest("--mesh", "1,4,1", "--steps", "0", "--restore-ckpt",
                          str(tmp_path / "ckpt"), "--out", str(tmp_path / "back.npz"))
    assert "'saved_by_processes': 1" in log
    assert bitwise_differences(load(tmp_path / "back.npz"), _state_only(two)) == []
