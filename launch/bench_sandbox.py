"""Benchmark: what one process-sandbox run costs (jrl.envs.process_sandbox), in time and memory.

    python -m launch.bench_sandbox                                   # print the table
    python -m launch.bench_sandbox --out docs/results/sandbox.json   # also a result file
    python -m launch.bench_sandbox --render docs/results/sandbox.json

Rows, each timed over --runs runs of `print(1)` after one warm-up run, one run at a time:
  bare python      `python -I -S -c "print(1)"` with subprocess.run: the floor.
  sandbox rlimits  ProcessSandbox(isolation="rlimits").run_python("print(1)").
  sandbox namespaces  the same with isolation="namespaces" (where it works here).
  ast interpreter  jrl.envs.sandbox.run_python("print(1)") in this process, for scale.
Peak RSS: the sandboxed CPython's own peak resident set (_PEAK_RSS, measured inside the sandbox),
median over --runs runs. The host keeps a thread and two pipes per run. Then the throughput of
SandboxPool: --runs * 2 runs with 1 worker and with os.cpu_count() workers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

from jrl.envs import ProcessSandbox, SandboxPool
from jrl.envs import run_python as ast_run_python
from jrl.envs.process_sandbox import namespace_problem, python_executable


# The program's own peak resident set, in KiB: VmHWM where /proc is mounted (rlimits: the
# trainer's fork before the exec does not count there), else ru_maxrss (namespaces: no /proc; the
# setup step ran in the same process before the exec, with less).
_PEAK_RSS = """\
import resource
try:
    with open('/proc/self/status') as status:
        kib = int([line for line in status if line.startswith('VmHWM')][0].split()[1])
except OSError:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kib
"""


def _timed(fn, runs: int) -> tuple[list[float], list]:
    fn()   # warm-up: imports, page cache, the namespace probe
    times, outputs = [], []
    for _ in range(runs):
        start = time.perf_counter()
        outputs.append(fn())
        times.append(time.perf_counter() - start)
    return times, outputs


def _row(name: str, times: list[float], rss: list[int] | None = None) -> dict:
    ordered = sorted(times)
    row = dict(name=name, runs=len(times), mean_ms=1e3 * statistics.mean(times),
               median_ms=1e3 * statistics.median(times),
               p90_ms=1e3 * ordered[int(0.9 * (len(ordered) - 1))], max_ms=1e3 * ordered[-1])
    if rss:
        row["peak_rss_mib"] = statistics.median(rss) / 2**20
    return row


def _throughput(sandbox: ProcessSandbox, workers: int, runs: int) -> dict:
    with SandboxPool(sandbox, workers=workers) as pool:
        pool.run_python(["print(1)"] * workers)          # warm-up
        start = time.perf_counter()
        results = pool.run_python(["print(1)"] * runs)
        seconds = time.perf_counter() - start
    assert all(r.ok for r in results)
    return dict(isolation=sandbox.isolation, workers=workers, runs=runs,
                runs_per_s=runs / seconds)


def measure(runs: int) -> dict:
    python = python_executable()
    rows = []
    times, _ = _timed(lambda: subprocess.run([python, "-I", "-S", "-c", "print(1)"],
                                             capture_output=True, check=True), runs)
    rows.append(_row("bare python", times))
    isolations = ["rlimits"] + (["namespaces"] if namespace_problem() is None else [])
    pools = []
    for isolation in isolations:
        sandbox = ProcessSandbox(isolation=isolation)
        times, results = _timed(lambda: sandbox.run_python("print(1)"), runs)
        assert all(r.ok and r.stdout == "1\n" for r in results), results[-1]
        rss = [int(sandbox.run_python(_PEAK_RSS).stdout) * 1024 for _ in range(runs)]
        rows.append(_row(f"sandbox {isolation}", times, rss))
        for workers in sorted({1, os.cpu_count() or 1}):
            pools.append(_throughput(sandbox, workers, 2 * runs))
    times, _ = _timed(lambda: ast_run_python("print(1)"), runs)
    rows.append(_row("ast interpreter", times))
    return dict(rows=rows, pools=pools, namespace_problem=namespace_problem())


def render(result: dict) -> str:
    machine = result["machine"]
    lines = [f"commit {result['commit'][:10]}, {result['date']}; "
             f"{machine.get('cpu_model') or machine['processor']}, {machine['cpu_count']} cores, "
             f"kernel {result['inputs']['kernel']}, as {result['inputs']['user']}, load "
             f"{result['inputs']['load_average_at_start']:.1f} at start; "
             f"{result['inputs']['runs']} runs of print(1) each.", "",
             "| run | mean ms | median ms | p90 ms | max ms | peak RSS MiB |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        rss = f"{row['peak_rss_mib']:.1f}" if "peak_rss_mib" in row else ""
        lines.append(f"| {row['name']} | {row['mean_ms']:.2f} | {row['median_ms']:.2f} | "
                     f"{row['p90_ms']:.2f} | {row['max_ms']:.2f} | {rss} |")
    lines += ["", "| pool | workers | runs | runs/s |", "|---|---|---|---|"]
    for pool in result["pools"]:
        lines.append(f"| {pool['isolation']} | {pool['workers']} | {pool['runs']} | "
                     f"{pool['runs_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per row (default 20)")
    parser.add_argument("--out", help="write the result file (figures, inputs, commit, date, "
                                      "machine) here")
    parser.add_argument("--render", help="print the table of an existing result file and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    from launch.result_file import commit, machine
    load_at_start = os.getloadavg()[0]
    figures = measure(args.runs)
    result = dict(tool="bench_sandbox", commit=commit(), machine=machine(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  inputs=dict(runs=args.runs, program="print(1)", kernel=os.uname().release,
                              user="root" if os.geteuid() == 0 else "a regular user",
                              load_average_at_start=load_at_start,
                              python=os.path.basename(python_executable())),
                  **figures)
    print(render(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
