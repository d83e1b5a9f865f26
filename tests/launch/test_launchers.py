"""The cluster launchers' dry runs: what each host or task would run, with which environment."""

import os
import pathlib
import shlex
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMAND = ["jrl", "train", "--config", "arith_tiny"]


def test_slurm_script_gives_each_task_the_coordinator_and_its_ids(tmp_path):
    # SLURM's scontrol expands the node list; a stand-in prints two hostnames.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho gpu01\necho gpu02\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "JRL_DRY_RUN": "1",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "4",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "1234"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm_gpu.sbatch"), *COMMAND],
                         env=env, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 4
    for task, line in enumerate(lines):
        # Port 8476 + 1234 % 1000 = 8710 on the first node; one GPU per task, numbered within
        # its node: tasks 0, 1 on gpu01 own GPUs 0, 1, tasks 2, 3 on gpu02 own 0, 1 again.
        assert line == (f"task {task}: JRL_COORDINATOR=gpu01:8710 JRL_NUM_PROCESSES=4 "
                        f"JRL_PROCESS_ID={task} JAX_LOCAL_DEVICE_IDS={task % 2} "
                        + " ".join(COMMAND))


def test_slurm_script_gives_a_process_per_node_its_block_of_gpus(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho node7\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "JRL_DRY_RUN": "1",
           "SLURM_JOB_NODELIST": "node7", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_JOB_ID": "5", "JRL_GPUS_PER_PROCESS": "8"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm_gpu.sbatch"), *COMMAND],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert "JRL_COORDINATOR=node7:8481 " in out                 # 8476 + 5 % 1000
    assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7 " in out


def test_tpu_script_runs_the_command_on_every_worker_with_auto_coordination():
    env = {**os.environ, "JRL_DRY_RUN": "1"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "tpu_pod.sh"), "my-tpu",
                          "us-central2-b", "my-project", "--", *COMMAND],
                         env=env, capture_output=True, text=True, check=True).stdout
    words = shlex.split(out)
    assert words[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu",
                         "--zone=us-central2-b"]
    assert "--worker=all" in words and "--project=my-project" in words
    (remote,) = [w[len("--command="):] for w in words if w.startswith("--command=")]
    assert remote == ("cd ~/jrl && source ~/jrl/.venv/bin/activate && export "
                      "JRL_COORDINATOR=auto JRL_INIT_TIMEOUT_S=300 && exec "
                      + " ".join(COMMAND) + " ")


def test_tpu_script_refuses_a_command_line_without_the_separator():
    done = subprocess.run(["bash", str(ROOT / "launch" / "tpu_pod.sh"), "my-tpu", "zone",
                           "jrl", "train"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
