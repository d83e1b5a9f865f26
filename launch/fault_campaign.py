"""Fault injection: kill a run at random times, resume it, and check it ends bitwise equal.

    python -m launch.fault_campaign [--trials 10] [--seed 0] [--steps 8] [--kills 1]
                                    [--workdir DIR]

One uninterrupted reference run of a tiny config (jrl/configs/arith_tiny.py shrunk by
`CAMPAIGN_OVERRIDES`: a 12k-parameter model, a 10-step warm start, a 4-problem greedy eval at
steps 0 and N, a checkpoint every step) through the real CLI, `python -m jrl.cli.train`, whose
output lines are timestamped to measure the run's phases (setup, warm start, step-0 eval, step 1
.. N, exit). Then each trial starts the same run fresh in its own directory and sends SIGINT,
SIGTERM or SIGKILL (cycled over trials) at a random point: a phase drawn uniformly (so the kills
spread over the warm start, the compile-heavy first step, the short later steps and their
checkpoint writes rather than bunching where the run spends most of its wall time) and an offset
into it drawn uniformly over the phase's reference duration, counted from when the trial's own
log enters that phase. Then it resumes the run with `--resume` until it finishes (the first
`--kills` attempts of a trial are each killed once). The trial's final checkpoint (train
state: params, optimizer state, RNG, step, version; the KL reference params; the metadata with
the data position) and its metrics rows without the wall-clock `time/*` fields must equal the
reference's bit for bit, and every signalled attempt must have stopped as promised
(`stop_problem`: exit 128 + the signal, a checkpoint of its last finished step).

One line per trial (signal, delay, the phase the kill landed in as the trial's own log and
workdir show it, exit code, resumes, equal or the differences), then `trials=<n> equal=<m>`;
the exit code is 1 when any trial differs. Everything is written under --workdir (default a new
temporary directory): reference/, trial-NN/run (the trial's run), trial-NN/attempt-K.log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join("configs", "arith_tiny.py")
# The tests' tiny model and batch on arith_tiny's task and objective (GRPO with a KL reference,
# so the checkpoint holds reference params as well). A checkpoint every step gives SIGKILL a
# resume point near the kill, and makes every step end with a checkpoint write to land in.
CAMPAIGN_OVERRIDES = (
    "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_layers=1",
    "model.arch.num_heads=2", "model.arch.num_kv_heads=1", "model.arch.head_dim=16",
    "data.train_size=64", "data.eval_size=4", "sampling.max_new_tokens=8",
    "sampling.group_size=4", "rollout.prompts_per_step=4", "rollout.num_slots=16",
    "rollout.steps_per_call=8", "train.sft_steps=10", "train.sft_batch_size=8",
    "eval.every=0", "eval.sampled=false", "checkpoint.every=1", "checkpoint.keep=2",
    "metrics.backends=[jsonl]",
)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
# Every wall-clock metric lives under time/ (jrl.metrics.names); all other fields are
# functions of the config and must repeat exactly.
WALL_CLOCK_PREFIX = "time/"
ATTEMPT_TIMEOUT_FACTOR = 10     # an attempt may take this many times the reference run
CHECKPOINT_LINE = re.compile(r"checkpoint: step (\d+) ")
RESUME_LINE = re.compile(r"resume: from step (\d+) ")


# ----------------------------------------------------------------------------------------------
# Bitwise comparison of finished runs

def _leaf_bits(leaf: Any):
    """A checkpoint leaf as a contiguous numpy array whose bytes are its bits (typed PRNG keys
    as their key data)."""
    import jax
    import numpy as np
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.ascontiguousarray(np.asarray(leaf))


def tree_differences(expected: Any, actual: Any, what: str = "") -> list[str]:
    """One line per difference between two pytrees of arrays, [] when they are bitwise equal:
    a leaf path only in one tree, a dtype or shape that differs, or bits that differ (with the
    count of differing elements). Unlike `==` this tells -0.0 from 0.0 and compares NaNs by
    their bits."""
    import jax
    import numpy as np
    flatten = jax.tree_util.tree_flatten_with_path
    expected_leaves = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(expected)[0]}
    actual_leaves = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(actual)[0]}
    differences = []
    for path in sorted(set(expected_leaves) | set(actual_leaves)):
        if path not in actual_leaves or path not in expected_leaves:
            side = "reference" if path in expected_leaves else "trial"
            differences.append(f"{what}{path}: only in the {side}")
            continue
        a, b = _leaf_bits(expected_leaves[path]), _leaf_bits(actual_leaves[path])
        if a.dtype != b.dtype or a.shape != b.shape:
            differences.append(f"{what}{path}: {a.dtype}{list(a.shape)} vs "
                               f"{b.dtype}{list(b.shape)}")
        elif a.tobytes() != b.tobytes():
            # Element-wise on the raw bytes: [size, itemsize] rows, one per element.
            rows_a = a.reshape(-1).view(np.uint8).reshape(a.size, -1)
            rows_b = b.reshape(-1).view(np.uint8).reshape(b.size, -1)
            count = int((rows_a != rows_b).any(axis=1).sum())
            differences.append(f"{what}{path}: {count} of {a.size} elements differ in bits")
    return differences


def metrics_differences(expected_rows: list[dict], actual_rows: list[dict]) -> list[str]:
    """One line per metrics row that differs outside the wall-clock time/* fields, [] when all
    rows are equal. Values are compared as their JSON text (Python's shortest round-trip float
    repr), which tells floats apart bit for bit, -0.0 from 0.0 included."""
    def without_wall_clock(row: dict) -> dict:
        return {key: value for key, value in row.items()
                if not key.startswith(WALL_CLOCK_PREFIX)}

    differences = []
    if [row["step"] for row in expected_rows] != [row["step"] for row in actual_rows]:
        differences.append(f"metrics steps {[row['step'] for row in expected_rows]} vs "
                           f"{[row['step'] for row in actual_rows]}")
    for expected, actual in zip(map(without_wall_clock, expected_rows),
                                map(without_wall_clock, actual_rows)):
        keys = sorted(set(expected) | set(actual))
        differing = [key for key in keys
                     if json.dumps(expected.get(key)) != json.dumps(actual.get(key))
                     or (key in expected) != (key in actual)]
        if differing:
            shown = ", ".join(f"{key}: {expected.get(key)!r} vs {actual.get(key)!r}"
                              for key in differing[:3])
            more = f" (+{len(differing) - 3} more)" if len(differing) > 3 else ""
            differences.append(f"metrics step {expected.get('step')}: {shown}{more}")
    return differences


def checkpoint_steps(run_dir: str) -> list[int]:
    """The step numbers of the complete checkpoints in run_dir/checkpoints (Orbax renames a
    step's temporary folder to the bare number once it is written)."""
    directory = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def load_checkpoint(run_dir: str, step: int) -> dict[str, Any]:
    """{"state": ..., "reference": ... (when saved), "meta": dict} of one checkpoint step, read
    without a target structure: the items jrl.train.checkpoint.Checkpointer writes."""
    import orbax.checkpoint as ocp
    step_dir = os.path.join(run_dir, "checkpoints", str(step))
    items: dict[str, Any] = {}
    checkpointer = ocp.StandardCheckpointer()
    for name in ("state", "reference"):
        if os.path.isdir(os.path.join(step_dir, name)):
            items[name] = checkpointer.restore(os.path.join(step_dir, name))
    checkpointer.close()
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
        items["meta"] = json.load(f)
    return items


def run_differences(reference_dir: str, trial_dir: str) -> list[str]:
    """Differences between two finished runs' final checkpoints and metrics; [] when equal."""
    from jrl.metrics.writers import read_metrics
    reference_steps, trial_steps = checkpoint_steps(reference_dir), checkpoint_steps(trial_dir)
    if not trial_steps or trial_steps[-1] != reference_steps[-1]:
        return [f"final checkpoint step {trial_steps[-1] if trial_steps else None}, expected "
                f"{reference_steps[-1]}"]
    expected = load_checkpoint(reference_dir, reference_steps[-1])
    actual = load_checkpoint(trial_dir, trial_steps[-1])
    differences = []
    for item in ("state", "reference"):
        if (item in expected) != (item in actual):
            differences.append(f"checkpoint item {item!r} saved in only one run")
        elif item in expected:
            differences += tree_differences(expected[item], actual[item], what=item)
    for key in sorted(set(expected["meta"]) | set(actual["meta"])):
        if json.dumps(expected["meta"].get(key), sort_keys=True) != json.dumps(
                actual["meta"].get(key), sort_keys=True):
            differences.append(f"meta {key}: {expected['meta'].get(key)!r} vs "
                               f"{actual['meta'].get(key)!r}")
    differences += metrics_differences(
        read_metrics(os.path.join(reference_dir, "metrics.jsonl")),
        read_metrics(os.path.join(trial_dir, "metrics.jsonl")))
    return differences


# ----------------------------------------------------------------------------------------------
# Running and killing the CLI

def phase_order(phase: str, steps: int) -> int:
    """The position of a `phase_after` phase in a run: setup 0, warm start 1, step-0 eval 2,
    step k 2 + k, exit steps + 3."""
    fixed = {"setup": 0, "warm start": 1, "step-0 eval": 2, "exit": steps + 3}
    return fixed[phase] if phase in fixed else 2 + int(phase.split()[1])


def phase_after(lines: list[str], steps: int) -> str:
    """The phase of a run whose output so far is `lines`: "setup", "warm start", "step-0 eval",
    "step k" (from the end of step k-1's checkpoint to the end of step k's) or "exit" (after
    the final checkpoint). Resumed runs skip to the step after the restored one."""
    phase, resumed_run = "setup", False
    for line in lines:
        checkpoint, resumed = CHECKPOINT_LINE.match(line), RESUME_LINE.match(line)
        resumed_run = resumed_run or bool(resumed)
        if line.startswith("jrl run ") and not resumed_run:   # logged after a resume's line
            phase = "warm start"
        elif line.startswith("warm start: "):
            phase = "step-0 eval"
        elif line.startswith("eval at step 0"):
            phase = "step 1"
        elif checkpoint or resumed:
            done = int((checkpoint or resumed).group(1))
            phase = "exit" if done >= steps else f"step {done + 1}"
    return phase


class Attempt:
    """One `python -m jrl.cli.train` process whose output lines are kept with their times
    (seconds since start) and copied to log_path."""

    def __init__(self, run_dir: str, steps: int, log_path: str, *, resume: bool):
        command = [sys.executable, "-m", "jrl.cli.train", "--config", BASE_CONFIG,
                   "--workdir", run_dir]
        for override in CAMPAIGN_OVERRIDES + (f"train.steps={steps}",):
            command += ["--set", override]
        if resume:
            command.append("--resume")
        environment = dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1")
        self.lines: list[tuple[float, str]] = []
        self.start = time.monotonic()
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=environment, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, args=(log_path,), daemon=True)
        self._reader.start()

    def _read(self, log_path: str) -> None:
        with open(log_path, "w") as log:
            for line in self.process.stdout:
                self.lines.append((time.monotonic() - self.start, line.rstrip("\n")))
                log.write(line)

    def __enter__(self) -> "Attempt":
        return self

    def __exit__(self, *exc_info) -> None:
        # The campaign itself stopped (Ctrl-C, an error): leave no training process behind.
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def texts(self) -> list[str]:
        return [text for _, text in list(self.lines)]

    def wait(self, timeout: float) -> int:
        """The exit code; a process still running after `timeout` seconds is killed (-9)."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._reader.join()
        return code


def measure_reference(run_dir: str, steps: int, log_path: str) -> list[tuple[str, float, float]]:
    """Runs the reference to the end; returns its phases as (name, start s, end s)."""
    with Attempt(run_dir, steps, log_path, resume=False) as attempt:
        code = attempt.wait(timeout=3600)
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit code {code}); see {log_path}")
    phases, start, current = [], 0.0, "setup"
    for index, (when, _) in enumerate(attempt.lines):
        phase = phase_after(attempt.texts()[:index + 1], steps)
        if phase != current:
            phases.append((current, start, when))
            start, current = when, phase
    phases.append((current, start, attempt.elapsed()))
    return phases


def _landing(attempt: Attempt, run_dir: str, steps: int) -> str:
    """Where a kill sent now lands, from the attempt's output and its workdir: the phase, and in
    step k whether step k's metrics row is already written (so its checkpoint is being written)
    or an unfinished Orbax folder is there."""
    phase = phase_after(attempt.texts(), steps)
    if not phase.startswith("step "):
        return phase
    step = int(phase.split()[1])
    checkpoints = os.path.join(run_dir, "checkpoints")
    unfinished = [name for name in (os.listdir(checkpoints) if os.path.isdir(checkpoints)
                                    else []) if not name.isdigit() and "tmp" in name]
    if unfinished:
        return f"{phase}: checkpoint write"
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            complete = [line for line in f.read().split("\n")[:-1] if line.strip()]
        if complete and json.loads(complete[-1])["step"] == step:
            return f"{phase}: metrics written, checkpoint next"
    return f"{phase}: rollout/train" + ("/final eval" if step == steps else "")


def _own_report(lines: list[str]) -> str:
    """What an interrupted run said it did (SIGINT / SIGTERM), or "" when it said nothing."""
    for line in reversed(lines):
        if "interrupted: saving step" in line:
            return "saved step " + line.split("saving step ")[1].split()[0]
        if line.startswith("interrupted: step ") and line.endswith(" is saved; stopping"):
            return f"step {line.split()[2]} was saved"
        if "interrupted before step" in line:
            return "nothing to save"
        if line.startswith("stopped during setup"):
            return "stopped in setup"
        if line.startswith("stopped; no checkpoint"):
            return "no checkpoint yet"
    return ""


def stop_problem(signum: int, code: int, run_dir: str) -> str | None:
    """Why a signalled attempt did not stop as promised, or None: SIGKILL ends it with -9; SIGINT
    and SIGTERM end it with 128 + the signal (or 0 when the run finished first) and leave a
    checkpoint of the last step it wrote metrics for (an attempt that ignored its signal would
    finish and still compare equal, so the exit status is what shows it)."""
    if signum == signal.SIGKILL:
        return None if code == -signal.SIGKILL else f"exit {code} after SIGKILL"
    if code not in (0, 128 + signum):
        return (f"exit {code} after {signal.Signals(signum).name} (expected {128 + signum}, or "
                "0 if the run finished first)")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    last_row = None
    if os.path.exists(metrics_path):
        rows = [line for line in open(metrics_path).read().split("\n") if line.strip()]
        last_row = json.loads(rows[-1])["step"] if rows else None
    checkpoints = os.path.join(run_dir, "checkpoints")
    saved = [int(d) for d in os.listdir(checkpoints) if d.isdigit()] \
        if os.path.isdir(checkpoints) else []
    if last_row is not None and last_row > 0 and max(saved, default=None) != last_row:
        return (f"step {last_row} wrote metrics but the last checkpoint is "
                f"{max(saved, default=None)}")
    return None


def run_trial(trial_dir: str, steps: int, kills: list[tuple[signal.Signals, str, float]],
              timeout: float) -> tuple[list[str], int, str | None]:
    """Starts the run fresh and kills attempt j with kills[j] = (signal, phase, offset): sent
    `offset` seconds after the attempt's log shows it entered `phase` (or a later one, for a
    resumed attempt that skips it), timed on the attempt itself rather than on the reference's
    clock, so that a 0.2 s step is hit although runs differ by seconds. Then resumes until an
    unkilled attempt ends. Returns (one description per kill, resumes, error or None)."""
    run_dir = os.path.join(trial_dir, "run")
    described, attempt_number = [], 0
    while True:
        attempt_number += 1
        log_path = os.path.join(trial_dir, f"attempt-{attempt_number}.log")
        with Attempt(run_dir, steps, log_path, resume=attempt_number > 1) as attempt:
            resumes = attempt_number - 1
            if attempt_number > len(kills):
                code = attempt.wait(timeout)
                if code != 0:
                    last = attempt.texts()[-1] if attempt.lines else ""
                    return described, resumes, f"attempt {attempt_number} exit code {code}: {last}"
                return described, resumes, None
            signum, phase, offset = kills[attempt_number - 1]
            target = phase_order(phase, steps)
            while attempt.process.poll() is None and attempt.elapsed() < timeout and \
                    phase_order(phase_after(attempt.texts(), steps), steps) < target:
                time.sleep(0.005)
            entered = attempt.elapsed()
            while attempt.process.poll() is None and attempt.elapsed() < entered + offset:
                time.sleep(0.005)
            name = signal.Signals(signum).name
            if attempt.process.poll() is not None:
                code = attempt.wait(timeout)
                described.append(f"{name} {offset:.2f}s into {phase}: the run finished first "
                                 f"(exit {code})")
                if code != 0:
                    return described, resumes, f"attempt {attempt_number} exit code {code}"
                return described, resumes, None
            where, sent = _landing(attempt, run_dir, steps), attempt.elapsed()
            attempt.process.send_signal(signum)
            code = attempt.wait(timeout)
            said = _own_report(attempt.texts())
            described.append(f"{name} {offset:.2f}s into {phase} (t={sent:.1f}s), landed in "
                             f"{where} (exit {code}" + (f", {said})" if said else ")"))
            problem = stop_problem(signum, code, run_dir)
            if problem:
                return described, resumes, f"attempt {attempt_number}: {problem}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8, help="RL steps of the run")
    parser.add_argument("--kills", type=int, default=1,
                        help="kill the first KILLS attempts of each trial (the fresh start and "
                             "KILLS-1 resumes)")
    parser.add_argument("--workdir", default=None,
                        help="where all runs and logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    for name in ("trials", "steps", "kills"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="jrl-fault-campaign-"))
    if os.path.isdir(workdir) and os.listdir(workdir):
        parser.error(f"--workdir {workdir}: not empty; give a new or empty directory")
    os.makedirs(workdir, exist_ok=True)
    print(f"fault campaign in {workdir}: {args.trials} trials, {args.steps} steps, "
          f"{args.kills} kill(s) per trial, seed {args.seed}", flush=True)

    reference_dir = os.path.join(workdir, "reference", "run")
    os.makedirs(os.path.dirname(reference_dir))
    phases = measure_reference(reference_dir, args.steps,
                               os.path.join(workdir, "reference", "attempt-1.log"))
    duration = phases[-1][2]
    print(f"reference: {duration:.1f}s: " + ", ".join(
        f"{name} {end - start:.2f}s" for name, start, end in phases), flush=True)

    rng = random.Random(args.seed)
    equal, campaign_start = 0, time.monotonic()
    for trial in range(args.trials):
        kills = []
        for kill in range(args.kills):
            phase, start, end = rng.choice(phases)
            kills.append((SIGNALS[(trial * args.kills + kill) % len(SIGNALS)], phase,
                          rng.uniform(0.0, end - start)))
        trial_dir = os.path.join(workdir, f"trial-{trial + 1:02d}")
        os.makedirs(trial_dir)
        described, resumes, error = run_trial(trial_dir, args.steps, kills,
                                              timeout=ATTEMPT_TIMEOUT_FACTOR * duration)
        differences = [error] if error else run_differences(
            reference_dir, os.path.join(trial_dir, "run"))
        equal += not differences
        verdict = "yes" if not differences else "NO: " + "; ".join(differences[:4]) + (
            f" (+{len(differences) - 4} more)" if len(differences) > 4 else "")
        print(f"trial {trial + 1}: {'; '.join(described)} | resumes {resumes} | bitwise equal "
              f"{verdict}", flush=True)
    print(f"{args.trials} trials in {(time.monotonic() - campaign_start) / 60:.1f} min",
          flush=True)
    print(f"trials={args.trials} equal={equal}", flush=True)
    return 0 if equal == args.trials else 1


if __name__ == "__main__":
    # SIGTERM unwinds like Ctrl-C, so the running attempt is killed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
