"""The figures of one finished run, as a result file the docs render (a run, not a benchmark).

    python -m launch.demo_summary runs/arith_tiny            # docs/results/demo.json
    python -m launch.demo_summary runs/arith_tiny --out FILE --wall-s 251
    python -m launch.demo_summary --render docs/results/demo.json

Read from the run's metrics.jsonl: greedy and sampled eval accuracy at every evaluated step,
the rollout reward averaged over the first and the last ten RL steps, the largest
`mismatch/logprob_abs_diff_max` of any step (0.0 on the exact path) and the number of steps
that measured it, and the RL steps' summed wall time; from its config.json the config's name and the numerics that
shape the bits (compute dtype, KV cache and matmul storage). --wall-s records the end-to-end wall time
of the command that made the run (`make demo` in a fresh clone, timed by the caller).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

from jrl.metrics import names

WINDOW = 10
# The contract fields a demo variant changes (docs/fp8.md compares them).
NUMERICS = ("compute_dtype", "kv_dtype", "matmul_dtype")


def summarize(workdir: str) -> dict:
    """The figures of the run in workdir (module docstring)."""
    path = os.path.join(workdir, "metrics.jsonl")
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise SystemExit(f"demo_summary: {path} does not exist (run the job first)") from None
    evals = [row for row in rows if names.EVAL_ACCURACY_GREEDY in row]
    steps = [row for row in rows if names.ROLLOUT_REWARD_MEAN in row]
    if not evals or not steps:
        raise SystemExit(f"demo_summary: {path} holds no eval or RL step rows")
    mismatch = [row[names.MISMATCH_LOGPROB_ABS_DIFF_MAX] for row in steps
                if names.MISMATCH_LOGPROB_ABS_DIFF_MAX in row]

    def mean(values):
        return sum(values) / len(values)

    return dict(
        **_numerics(workdir),
        steps=len(steps),
        eval=[dict(step=row["step"], greedy=row[names.EVAL_ACCURACY_GREEDY],
                   sampled=row.get(names.EVAL_ACCURACY_SAMPLED)) for row in evals],
        reward_first=mean([row[names.ROLLOUT_REWARD_MEAN] for row in steps[:WINDOW]]),
        reward_last=mean([row[names.ROLLOUT_REWARD_MEAN] for row in steps[-WINDOW:]]),
        mismatch_max=max(mismatch) if mismatch else None,
        mismatch_steps=len(mismatch),
        rl_steps_s=sum(row.get(names.TIME_STEP_S, 0.0) for row in steps))


def _numerics(workdir: str) -> dict:
    """The config's name and its numerics' dtypes, from the run's config.json (empty when the
    run wrote none)."""
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    numerics = config.get("numerics", {})
    return dict(config=config.get("name"),
                numerics={key: numerics.get(key, "compute") if key != "compute_dtype"
                          else numerics.get(key) for key in NUMERICS})


def render(result: dict) -> str:
    """The markdown table of a result file."""
    machine = result["machine"]
    wall = (f", {result['wall_s'] / 60:.1f} min end to end" if result.get("wall_s") else "")
    numerics = result.get("numerics")
    setting = ("" if not numerics else "Numerics " + ", ".join(
        f"{key}={value}" for key, value in numerics.items()) + "; ")
    lines = [f"{setting}Commit {result['commit'][:10]}, {result['date']}; "
             f"{machine.get('cpu_model') or machine['processor']}, "
             f"{machine['cpu_count']} cores, JAX {machine['jax']}{wall}; RL steps "
             f"{result['rl_steps_s']:.0f} s.", "",
             "| step | " + " | ".join(str(e["step"]) for e in result["eval"]) + " |",
             "|---|" + "---|" * len(result["eval"]),
             "| greedy eval accuracy | " + " | ".join(f"{e['greedy']:.3f}"
                                                      for e in result["eval"]) + " |",
             "| sampled eval accuracy | " + " | ".join(
                 "-" if e["sampled"] is None else f"{e['sampled']:.3f}"
                 for e in result["eval"]) + " |", "",
             f"Rollout reward {result['reward_first']:.3f} (steps 1-{WINDOW}) -> "
             f"{result['reward_last']:.3f} (the last {WINDOW}); "
             f"`mismatch/logprob_abs_diff_max` at most {result['mismatch_max']} over the "
             f"{result['mismatch_steps']} of {result['steps']} steps that measured it."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workdir", nargs="?", help="the run's directory")
    parser.add_argument("--out", default=os.path.join("docs", "results", "demo.json"))
    parser.add_argument("--wall-s", type=float, default=None,
                        help="end-to-end wall time of the command that made the run")
    parser.add_argument("--render", metavar="FILE", help="print FILE's markdown table and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    if not args.workdir:
        parser.error("give the run's directory (or --render FILE)")
    from launch.result_file import commit, machine
    result = dict(tool="demo_summary", workdir=os.path.basename(os.path.normpath(args.workdir)),
                  commit=commit(), machine=machine(), wall_s=args.wall_s,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  **summarize(args.workdir))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
