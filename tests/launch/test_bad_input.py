"""The bad-input probe, re-run through the real CLI: each case exits 2 with one line on stderr
naming the field (no traceback), before any training.

    python -m jrl.cli.train --config jrl/configs/arith_tiny.py --set KEY=VALUE ...

The CLI takes one config per process, so each case is a subprocess; they run a few at a time
(module fixture). Range rules field by field are tested in process:
tests/pipeline/test_config_validation.py."""

import concurrent.futures
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (case id, extra CLI arguments, text the one stderr line must hold). "{tmp}" is the case's
# temporary directory.
CASES = [
    ("b1", ["--set", "optimizer.b1=2"], "optimizer.b1=2.0: must be a number in [0, 1)"),
    ("eps", ["--set", "optimizer.eps=-1"], "optimizer.eps=-1.0: must be a finite number > 0"),
    ("temperature", ["--set", "sampling.temperature=inf"],
     "temperature=inf: must be a finite number > 0"),
    ("entropy_coef", ["--set", "algorithm.entropy_coef=-10"], "algorithm.entropy_coef=-10.0: must be"),
    ("std_power", ["--set", "algorithm.std_power=-1"], "algorithm.std_power=-1.0: must be"),
    ("format_reward", ["--set", "rollout.format_reward=nan"], "rollout.format_reward=nan"),
    ("drop_stale", ["--set", "pipeline.drop_stale_beyond=-1"],
     "pipeline.drop_stale_beyond=-1: must be an int >= 0"),
    ("num_terms", ["--set", "data.num_terms=0"], "data.num_terms=0: must be an int >= 1"),
    ("huge_seed", ["--set", "seed=99999999999999999999"], "must be an int in [0, 2**32)"),
    ("group_of_one", ["--set", "sampling.group_size=1", "--set", "algorithm.unbiased_std=true"],
     "sampling.group_size=1 with algorithm.recipe='grpo' and algorithm.unbiased_std=True"),
    ("stop_token", ["--set", "sampling.stop_tokens=(999999,)"],
     "sampling.stop_tokens=[999999]: [999999] outside the model's vocabulary"),
    ("positions", ["--set", "rollout.max_prompt_len=1000"],
     "rollout.max_prompt_len + sampling.max_new_tokens = 1000 + 28 = 1028 positions, more "
     "than the model's max_position_embeddings=64"),
    ("long_prompt", ["--set", "rollout.max_prompt_len=8"],
     "train data, example index 0 (id 0): the prompt has 20 tokens, more than "
     "rollout.max_prompt_len=8"),
    ("non_utf8", ["--set", "data.source=gsm8k_jsonl", "--set", "data.path={tmp}/latin1.jsonl"],
     "{tmp}/latin1.jsonl:2: not UTF-8 text"),
    ("export_onto_file", ["--export-hf", "{tmp}/model.bin"],
     "--export-hf '{tmp}/model.bin': exists and is a file"),
]


def _run_case(tmp: str, extra: list[str]) -> subprocess.CompletedProcess:
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "latin1.jsonl"), "wb") as f:
        f.write(b'{"question": "q", "answer": "#### 1"}\n'
                b'{"question": "caf\xe9", "answer": "#### 2"}\n')
    with open(os.path.join(tmp, "model.bin"), "w") as f:
        f.write("not a directory")
    command = [sys.executable, "-m", "jrl.cli.train", "--config", "jrl/configs/arith_tiny.py",
               "--workdir", os.path.join(tmp, "run"), "--set", "eval.every=0",
               "--set", "train.sft_steps=1", "--set", "train.steps=1",
               *[arg.replace("{tmp}", tmp) for arg in extra]]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's CompletedProcess, run three at a time."""
    base = str(tmp_path_factory.mktemp("bad_input"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(_run_case, os.path.join(base, name), extra)
                   for name, extra, _ in CASES}
        return {name: (future.result(), os.path.join(base, name))
                for name, future in futures.items()}


@pytest.mark.parametrize("name, extra, message", CASES, ids=[case[0] for case in CASES])
def test_bad_input_exits_2_with_one_line_naming_it(results, name, extra, message):
    done, tmp = results[name]
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert message.replace("{tmp}", tmp) in lines[0]
    assert not os.path.exists(os.path.join(tmp, "run", "metrics.jsonl"))   # nothing trained


def test_bench_peer_without_the_peer_says_what_to_install(monkeypatch):
    """bench_peer runs where Tunix is installed; elsewhere one line says what it needs."""
    import builtins

    from launch import bench_peer
    real_import = builtins.__import__

    def no_tunix(name, *args, **kwargs):
        if name.startswith("tunix"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tunix)
    with pytest.raises(SystemExit, match="pip install google-tunix"):
        bench_peer.main(["--repeats", "1"])


def test_bench_speed_dims_without_a_pair_that_takes_them_says_which(capsys):
    """--dims smollm2 changes three pairs, not the hybrid one: with every pair selected, the
    bench stops before building any model, with one line naming the three."""
    from launch import bench_speed
    with pytest.raises(SystemExit) as stopped:
        bench_speed.main(["--dims", "smollm2"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("--dims smollm2 applies to the shared_prefill, speculative and draft_model pairs"
            in error)
