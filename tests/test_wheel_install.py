"""The package as a user installs it: the wheel built from this checkout, installed into an
empty virtual environment (dependencies from the package index or its local cache), works away
from the repository: `jrl --help`, `jrl train --help`, `import jrl.losses`, and one RL step of a
shipped config found by name. Slow: it installs jax and the rest into the new environment."""

import pathlib
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["train.steps=1", "train.sft_steps=0", "data.train_size=16", "data.eval_size=0",
        "rollout.prompts_per_step=2", "sampling.group_size=2", "rollout.num_slots=4",
        "model.arch.num_layers=1", "sampling.max_new_tokens=4", "checkpoint.every=1"]


def _run(args, cwd, timeout=900):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_and_trains_outside_the_repository(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels),
          str(ROOT)], cwd=tmp_path)
    (wheel,) = wheels.glob("jrl-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python, jrl = env / "bin" / "python", env / "bin" / "jrl"
    _run([str(python), "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path)
    work = tmp_path / "elsewhere"      # not the repository: nothing imports from the checkout
    work.mkdir()
    assert "jrl train" in _run([str(jrl), "--help"], cwd=work)
    assert "--config" in _run([str(jrl), "train", "--help"], cwd=work)
    _run([str(python), "-c", "import jrl.losses, jrl.kernels; print(jrl.__version__)"], cwd=work)
    # Nothing installs as a top-level launch or configs package.
    for name in ("launch", "configs"):
        missing = subprocess.run([str(python), "-c", f"import {name}"], cwd=work,
                                 capture_output=True, text=True)
        assert missing.returncode != 0, f"{name} is importable from the installed wheel"
    sets = [arg for item in TINY for arg in ("--set", item)]
    out = _run([str(jrl), "train", "--config", "arith_tiny", "--workdir", str(work / "run"),
                *sets], cwd=work)
    assert (work / "run" / "metrics.jsonl").is_file(), out
