"""The seed article's experiments: one command each, one overlaid chart and one table each.

    python -m launch.experiment NAME [--steps 60] [--config F] [--set k=v ...]
                                [--out runs/experiments] [--docs docs/experiments]

NAME is one of EXPERIMENTS (or "all"):
  sync_async   max_staleness 0 / 1 / 2: reward and eval against step and against training time,
               step time, staleness, TIS weights.
  mismatch     Pallas vs XLA backend in bf16, each synchronous (k=0) and asynchronous (k=1),
               with the sampler's p_b as p_old: numerical mismatch vs staleness, the PPO
               ratio, ppo_kl and clip fractions from step 1 on.
  off_policy   asynchronous k=2 with no correction / token TIS / sequence TIS / token MIS.
  presets      grpo, dapo, dr_grpo, gspo, cispo (no KL term for any): reward, eval, response
               length and entropy (the article's length-bias discussion).
  moe_routing  the tiny MoE model (jrl/configs/moe_tiny.py) asynchronous at k=2: recompute vs
               replay (R3) routing on Pallas, and the XLA path's routing flips against
               Pallas's zero: routing agreement, stale flips, expert load, mismatch, reward.

Every run is the base config (default: the demo task, jrl/configs/arith_tiny_async.py for the first
three, jrl/configs/arith_tiny.py for presets; --config replaces both, e.g. a GPU-scale config) plus
the run's overrides, then --set. Runs are named by their settings and shared between experiments
(mismatch's pallas_k1 is sync_async's k1); a run whose metrics already reach --steps is reused.
The supervised warm start is run once per base config and its weights are given to every run
(train.sft_steps=0 in their saved configs; the warm start is in <out>/warm_start.log).

Writes <docs>/<NAME>.png (every run overlaid) and <docs>/<NAME>.md (a table per run).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # The asynchronous runs split 4 rollout + 4 train devices (host devices on a CPU).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from jrl.metrics import METRICS_FILENAME, names, read_metrics  # noqa: E402
from jrl.pipeline.config.tools import apply_overrides  # noqa: E402
from jrl.pipeline.loop.runner import Run  # noqa: E402
from jrl.cli.plot import Panel, plot_overlay  # noqa: E402
from jrl.cli.train import load_config  # noqa: E402

ASYNC_BASE = "jrl/configs/arith_tiny_async.py"
SYNC_BASE = "jrl/configs/arith_tiny.py"
MOE_BASE = "jrl/configs/moe_tiny.py"
# jrl/configs/arith_tiny_async.py's settings on top of the synchronous MoE config: 4 rollout + 4
# train devices, 4 micro-batches, p_old recomputed by the trainer, token TIS.
MOE_ASYNC = ["pipeline.rollout_devices=4", "pipeline.train_devices=4", "train.micro_batches=4",
             "train.old_logp=recompute", "algorithm.tis_cap=2.0", "pipeline.interrupt=true"]


@dataclasses.dataclass(frozen=True)
class Experiment:
    title: str
    base: str                              # config file the runs start from
    runs: dict                             # run name -> overrides
    panels: tuple
    columns: tuple                         # table columns: (header, metric, "first"/"last"/...)


def _k(k: int, backend: str = "pallas", dtype: str = "float32") -> list[str]:
    overrides = [f"pipeline.max_staleness={k}", f"numerics.backend={backend}"]
    return overrides + ([f"numerics.compute_dtype={dtype}"] if dtype != "float32" else [])


REWARD = Panel("reward", "Reward (mean)", (names.ROLLOUT_REWARD_MEAN,))
REWARD_WALL = Panel("reward_wall", "Reward vs training time", (names.ROLLOUT_REWARD_MEAN,),
                    x="wall")
EVAL = Panel("eval", "Greedy eval accuracy", (names.EVAL_ACCURACY_GREEDY,))
EVAL_WALL = Panel("eval_wall", "Greedy eval vs training time", (names.EVAL_ACCURACY_GREEDY,),
                  x="wall")
STEP_TIME = Panel("step_time", "Step time (s; step 1 also compiles)", (names.TIME_STEP_S,),
                  scale="log")
STALENESS = Panel("staleness", "Staleness (versions)",
                  (names.ROLLOUT_STALENESS_MEAN, names.ROLLOUT_STALENESS_MAX))
TIS = Panel("tis", "TIS weight", (names.TRAIN_TIS_MEAN, names.TRAIN_TIS_ABS))
MISMATCH = Panel("mismatch", "Numerical vs staleness drift |dlogp|",
                 (names.MISMATCH_NUMERICAL_ABS, names.MISMATCH_STALENESS_ABS), scale="symlog")
RATIO = Panel("ratio", "PPO ratio (min / max)", (names.TRAIN_RATIO_MIN, names.TRAIN_RATIO_MAX))
PPO_KL = Panel("ppo_kl", "ppo_kl", (names.TRAIN_PPO_KL,), scale="symlog")
CLIP = Panel("clip", "Clip fractions (low / high)",
             (names.TRAIN_PG_CLIPFRAC_LOW, names.TRAIN_PG_CLIPFRAC_HIGH), scale="symlog")
MIS = Panel("mis", "MIS masked fraction", (names.TRAIN_MIS_MASKED_FRAC,))
LENGTH = Panel("length", "Response length (tokens)", (names.ROLLOUT_RESPONSE_LEN_MEAN,))
ENTROPY = Panel("entropy", "Entropy (token mean)", (names.TRAIN_ENTROPY,))
GRAD = Panel("grad", "Gradient norm", (names.TRAIN_GRAD_NORM,))
ROUTING = Panel("routing", "Routing agreement, sampler vs trainer (same weights)",
                (names.MISMATCH_ROUTING_AGREEMENT,))
FLIPS = Panel("flips", "Routing flips from staleness alone",
              (names.MISMATCH_ROUTING_STALE_FLIP_FRAC,))
LOAD = Panel("load", "Expert load, max / mean", (names.TRAIN_EXPERT_LOAD_MAX,))
LOGPROB_MAX = Panel("logprob_max", "max |p_b - p_o| (same weights)",
                    (names.MISMATCH_LOGPROB_ABS_DIFF_MAX,), scale="symlog")

LEARNING = (("eval 0", names.EVAL_ACCURACY_GREEDY, "first"),
            ("eval end", names.EVAL_ACCURACY_GREEDY, "last"),
            ("reward 1-10", names.ROLLOUT_REWARD_MEAN, "head"),
            ("reward last 10", names.ROLLOUT_REWARD_MEAN, "tail"))

EXPERIMENTS = {
    "sync_async": Experiment(
        "Sync vs async (max_staleness 0 / 1 / 2; token TIS on a recomputed p_old)", ASYNC_BASE,
        {"pallas_k0": _k(0), "pallas_k1": _k(1), "pallas_k2": _k(2)},
        (REWARD, REWARD_WALL, EVAL, EVAL_WALL, STEP_TIME, STALENESS, TIS),
        LEARNING + (("step s (2..N)", names.TIME_STEP_S, "mean after first"),
                    ("staleness", names.ROLLOUT_STALENESS_MEAN, "mean"),
                    ("tis |w-1|", names.TRAIN_TIS_ABS, "mean"))),
    "mismatch": Experiment(
        "Numerical mismatch vs staleness (bf16; Pallas / XLA; k = 0 / 1; p_old = sampler's p_b)",
        ASYNC_BASE,
        # The article's setting: the sampler's logprobs are the PPO denominator (no recompute,
        # hence no TIS), so any sampler/trainer mismatch shows in the ratio from step 1 on.
        {f"{backend}_bf16_k{k}_behavior": _k(k, backend, "bfloat16") + [
            "train.old_logp=behavior", "algorithm.tis_cap=none"]
         for k in (0, 1) for backend in ("pallas", "xla")},
        (MISMATCH, RATIO, PPO_KL, CLIP, REWARD, EVAL),
        LEARNING + (("numerical", names.MISMATCH_NUMERICAL_ABS, "mean"),
                    ("staleness", names.MISMATCH_STALENESS_ABS, "mean"),
                    ("ratio max - 1 @1", names.TRAIN_RATIO_MAX, "first - 1"),
                    ("ppo_kl @1", names.TRAIN_PPO_KL, "first"),
                    ("clip low+high", names.TRAIN_PG_CLIPFRAC_LOW, "mean"))),
    "off_policy": Experiment(
        "Off-policy correction at k = 2", ASYNC_BASE,
        {"pallas_k2": _k(2), "pallas_k2_none": _k(2) + ["algorithm.tis_cap=none"],
         "pallas_k2_tis_seq": _k(2) + ["algorithm.tis_level=sequence"],
         "pallas_k2_mis": _k(2) + ["algorithm.tis_cap=none", "algorithm.mis_threshold=2.0"]},
        (REWARD, EVAL, TIS, MIS, PPO_KL, MISMATCH),
        LEARNING + (("staleness", names.MISMATCH_STALENESS_ABS, "mean"),
                    ("tis |w-1|", names.TRAIN_TIS_ABS, "mean"),
                    ("mis masked", names.TRAIN_MIS_MASKED_FRAC, "mean"))),
    "presets": Experiment(
        "Loss presets (synchronous, Pallas, no KL term, 4 updates per step)", SYNC_BASE,
        # 4 mini-batch updates per step: with one, every update is on-policy (ratio exactly 1),
        # so clipping never acts, GSPO's gradient equals GRPO's and CISPO's equals DAPO's.
        {f"preset_{p}_mb4": [f"algorithm.recipe={p}", "algorithm.kl_beta=0", "train.reference=none",
                             "train.mini_batches=4"]
         for p in ("grpo", "dapo", "dr_grpo", "gspo", "cispo")},
        (REWARD, EVAL, LENGTH, ENTROPY, CLIP, GRAD),
        LEARNING + (("length 1-10", names.ROLLOUT_RESPONSE_LEN_MEAN, "head"),
                    ("length last 10", names.ROLLOUT_RESPONSE_LEN_MEAN, "tail"),
                    ("entropy 1-10", names.TRAIN_ENTROPY, "head"),
                    ("entropy last 10", names.TRAIN_ENTROPY, "tail"))),
    "moe_routing": Experiment(
        "MoE routing at k = 2: recompute vs replay (R3); Pallas vs XLA (f32)", MOE_BASE,
        {f"moe_{backend}_k2_{routing}": _k(2, backend) + MOE_ASYNC + [f"model.routing={routing}"]
         for backend, routing in (("pallas", "recompute"), ("pallas", "replay"),
                                  ("xla", "recompute"), ("xla", "replay"))},
        (ROUTING, FLIPS, LOGPROB_MAX, MISMATCH, LOAD, REWARD, EVAL, TIS),
        LEARNING + (("agreement min", names.MISMATCH_ROUTING_AGREEMENT, "min"),
                    ("agreement mean", names.MISMATCH_ROUTING_AGREEMENT, "mean"),
                    ("stale flips", names.MISMATCH_ROUTING_STALE_FLIP_FRAC, "mean"),
                    ("|p_b-p_o| max", names.MISMATCH_LOGPROB_ABS_DIFF_MAX, "max"),
                    ("staleness |dlogp|", names.MISMATCH_STALENESS_ABS, "mean"),
                    ("tis |w-1|", names.TRAIN_TIS_ABS, "mean"),
                    ("load max", names.TRAIN_EXPERT_LOAD_MAX, "mean"))),
}


# ---------------------------------------------------------------------------------------------


def summarize(records: Sequence[dict], metric: str, how: str) -> float | None:
    """first / last value ("first - 1": minus one, for ratios), mean, min or max over all steps
    (or "mean after first": steps 2..N, since the first also compiles), or mean of the first
    (head) / last (tail) 10."""
    values = [r[metric] for r in records if isinstance(r.get(metric), (int, float))
              and not isinstance(r.get(metric), bool)]
    if not values:
        return None
    pick = {"first": lambda v: v[0], "first - 1": lambda v: v[0] - 1, "last": lambda v: v[-1],
            "mean": np.mean, "min": min, "max": max,
            "mean after first": lambda v: np.mean(v[1:] or v),
            "head": lambda v: np.mean(v[:10]), "tail": lambda v: np.mean(v[-10:])}[how]
    return float(pick(values))


def table(experiment: Experiment, runs: dict[str, list[dict]]) -> str:
    """A markdown table: one row per run, experiment.columns as columns."""
    headers = ["run"] + [header for header, _, _ in experiment.columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for name, records in runs.items():
        cells = [name]
        for _, metric, how in experiment.columns:
            value = summarize(records, metric, how)
            cells.append("-" if value is None else f"{value:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Runner:
    """Runs (or reuses) named runs under `out`, sharing one warm start per base config."""

    def __init__(self, out: str, steps: int, config_override: str | None, sets: list[str]):
        self.out, self.steps = out, steps
        self.config_override, self.sets = config_override, sets
        self._warm: dict[str, object] = {}

    def base_config(self, base: str):
        return load_config(self.config_override or base, [])

    def warm_params(self, base: str):
        if base not in self._warm:
            config = apply_overrides(self.base_config(base), self.sets)
            workdir = os.path.join(self.out, "warm_start_" + os.path.basename(base)[:-3])
            log_path = os.path.join(self.out, "warm_start.log")
            os.makedirs(self.out, exist_ok=True)
            with open(log_path, "a") as log_file:
                def log(line):
                    print(line)
                    log_file.write(line + "\n")
                run = Run(config, workdir, overwrite="delete", log=log, write_metrics=False)
                run.start_policy()
                self._warm[base] = run.trainer.params_on_host()
                run.close()
        return self._warm[base]

    def complete(self, workdir: str) -> list[dict] | None:
        path = os.path.join(workdir, METRICS_FILENAME)
        if not os.path.exists(path):
            return None
        records = read_metrics(path)
        return records if records and records[-1]["step"] >= self.steps else None

    def wall_seconds(self, name: str) -> float:
        """Seconds run `name` took when it ran (from its experiment.json; 0 if unknown)."""
        path = os.path.join(self.out, name, "experiment.json")
        if not os.path.exists(path):
            return 0.0
        with open(path) as f:
            return float(json.load(f).get("wall_s", 0.0))

    def run(self, name: str, base: str, overrides: list[str]) -> list[dict]:
        workdir = os.path.join(self.out, name)
        records = self.complete(workdir)
        if records is not None:
            print(f"{name}: reusing {workdir}")
            return records
        config = apply_overrides(self.base_config(base), overrides + self.sets + [
            f"train.steps={self.steps}", f"optimizer.total_steps={self.steps}",
            "checkpoint.every=0", "eval.sampled=false", f"eval.every={max(1, self.steps // 3)}"])
        warm = self.warm_params(base) if config.train.sft_steps else None
        if warm is not None:
            config = apply_overrides(config, ["train.sft_steps=0"])
        print(f"{name}: {' '.join(overrides)} ({self.steps} steps) -> {workdir}")
        start = time.perf_counter()
        with Run(config, workdir, overwrite="delete", log=lambda line: None) as run:
            if warm is not None:
                run.trainer.set_params(warm)
            run.run()
        with open(os.path.join(workdir, "experiment.json"), "w") as f:
            json.dump({"overrides": overrides + self.sets, "base": self.config_override or base,
                       "shared_warm_start": warm is not None,
                       "wall_s": time.perf_counter() - start}, f, indent=1)
        return read_metrics(os.path.join(workdir, METRICS_FILENAME))


def run_experiment(name: str, runner: Runner, docs: str) -> str:
    experiment = EXPERIMENTS[name]
    runs = {run_name: runner.run(run_name, experiment.base, overrides)
            for run_name, overrides in experiment.runs.items()}
    os.makedirs(docs, exist_ok=True)
    chart, notes = plot_overlay(runs, os.path.join(docs, f"{name}.png"), experiment.panels,
                                title=experiment.title)
    run_seconds = sum(runner.wall_seconds(run_name) for run_name in runs)
    text = (f"# {experiment.title}\n\n`python -m launch.experiment {name} --steps "
            f"{runner.steps}`: {len(runs)} runs, {run_seconds / 60:.1f} min of run time in all "
            "(warm start not included; runs shared with other experiments are counted here "
            "too)\n\n"
            + table(experiment, runs) + "\n")
    with open(os.path.join(docs, f"{name}.md"), "w") as f:
        f.write(text)
    for note in notes:
        print(f"note: {note}")
    print(text)
    print(f"wrote {chart} and {os.path.join(docs, name + '.md')}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.experiment",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("name", choices=sorted(EXPERIMENTS) + ["all"])
    parser.add_argument("--steps", type=int, default=60, help="RL steps per run (default 60)")
    parser.add_argument("--config", default=None,
                        help="base config for every run instead of the tiny demo task")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run (repeatable), e.g. model.path=...")
    parser.add_argument("--out", default="runs/experiments", help="run directories")
    parser.add_argument("--docs", default="docs/experiments", help="charts and tables")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    runner = Runner(args.out, args.steps, args.config, args.set)
    for name in sorted(EXPERIMENTS) if args.name == "all" else [args.name]:
        run_experiment(name, runner, args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
