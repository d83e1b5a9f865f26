"""Signals at many offsets into a real run: how many are honoured.

Runs `jrl train --config arith_tiny` with a 30-step warm start, an eval at step 0 and a
checkpoint every step (the shape of the probe that once lost 4 of 27 signals), and sends
SIGTERM or SIGINT a given delay after the line that ends the warm start, so the signals land in
the step-0 evaluation, the first steps and the checkpoints between them. A signal is honoured
when the run exits with 128 + the signal number and says it stopped; it is lost when the run
finishes its steps (exit 0) or ends any other way.

    python -m launch.signal_campaign --delays 0.1:2.0:0.1 --out docs/results/signal_campaign.json

Every run shares one persistent compilation cache, so only the first pays for compiling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from launch.result_file import commit, machine

MARKER = "warm start:"
OVERRIDES = ("train.sft_steps=30", "train.steps=4", "checkpoint.every=1", "eval.every=2",
             "data.eval_size=32")


def signal_after_marker(command: list[str], env: dict, marker: str, delay: float,
                        signum: int, cwd: str | None = None) -> tuple[int, str, bool]:
    """Starts `command`, sends `signum` `delay` seconds after its first output line containing
    `marker`; returns (exit status, all output, whether the signal was sent: the run may have
    ended first)."""
    process = subprocess.Popen(command, cwd=cwd, env={**env, "PYTHONUNBUFFERED": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            time.sleep(delay)
            break
    sent = process.poll() is None
    if sent:
        process.send_signal(signum)
    rest, _ = process.communicate(timeout=600)
    return process.returncode, "".join(lines) + rest, sent


def one_attempt(delay: float, signum: int, workdir: str, cache: str) -> dict:
    """One run signalled `delay` seconds after MARKER: its exit status and whether the signal
    was honoured."""
    command = [sys.executable, "-m", "jrl.cli.train", "--config", "arith_tiny", "--workdir",
               workdir, *[arg for o in OVERRIDES for arg in ("--set", o)]]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    code, output, sent = signal_after_marker(command, env, MARKER, delay, signum)
    stopped = ("interrupted: saving step" in output or "stopped;" in output)
    return {"delay_s": delay, "signal": signal.Signals(signum).name, "sent": sent,
            "exit": code, "honoured": sent and code == 128 + signum and stopped,
            "lost_traceback": "Exception ignored" in output}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.signal_campaign")
    parser.add_argument("--delays", default="0.1:2.0:0.1",
                        help="START:STOP:STEP seconds after the warm start's last line")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    start, stop, step = (float(x) for x in args.delays.split(":"))
    delays = [round(start + i * step, 3) for i in range(int(round((stop - start) / step)) + 1)]
    attempts = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "jax_cache")
        for i, delay in enumerate(delays):
            signum = signal.SIGTERM if i % 2 == 0 else signal.SIGINT
            attempt = one_attempt(delay, signum, os.path.join(tmp, f"run{i}"), cache)
            attempts.append(attempt)
            print(json.dumps(attempt), flush=True)
    sent = [a for a in attempts if a["sent"]]
    honoured = sum(a["honoured"] for a in sent)
    print(f"{honoured} of {len(sent)} signals honoured")
    if args.out:
        result = {"tool": "signal_campaign", "commit": commit(), "machine": machine(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "inputs": {"config": "arith_tiny", "overrides": list(OVERRIDES),
                             "marker": MARKER, "delays_s": delays},
                  "sent": len(sent), "honoured": honoured, "attempts": attempts}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if honoured == len(sent) else 1


if __name__ == "__main__":
    sys.exit(main())
