"""Sync vs async RL on a long-tailed response-length workload.

    python -m launch.bench_async [--steps 8] [--quick]            # real devices (4 + 4 CPU)
    python -m launch.bench_async --simulate [--steps 16] [--quick]  # simulated devices

Real mode: the same pipeline (max_staleness 0 vs 1) for the same number of optimizer steps on a
tiny random model whose responses are cut at per-request budgets from a long-tailed distribution
(most short, a few near the maximum), so a synchronous step waits for its longest responses while
the asynchronous one trains on the previous batch meanwhile. On a 2-core CPU both sides share the
same two cores, so this mostly measures contention.

Both compose public parts: the real mode injects a BudgetSampler through Run's sampler factory,
the simulated mode a simulated sampler and trainer (launch/simulate.py).

Simulated mode (launch/simulate.py): the real pipeline code (Run loop, sampler threads, admission
queue, Sampler.serve's slot refill and weight swaps, version tags, prepare_batch) with every device
call replaced by a timed wait from a cost model, so rollout and training overlap as on separate
accelerators. Sync, then k = 1, 2, 4 with and without interruptible generation.

The last line is `speedup=<async over sync> staleness_mean=<x>` (simulated: the best setting).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from jrl.kernels.contract import NumericalContract  # noqa: E402
from jrl.models.config import ModelConfig  # noqa: E402
from jrl.models.tokenizer import CharTokenizer  # noqa: E402
from jrl.pipeline.config import (CheckpointSection, DataSection, EvalSection,  # noqa: E402
                                     RunConfig, AlgorithmSection, MetricsSection, ModelSection,
                                     PipelineSection, RolloutSection, TrainSection)
from jrl.pipeline.setup.samplers import build_sampler  # noqa: E402
from jrl.pipeline.loop.runner import Run  # noqa: E402
from jrl.sampling import Sampler  # noqa: E402
from jrl.sampling.params import SamplingParams  # noqa: E402
from jrl.train.optimizer import OptimizerConfig  # noqa: E402
from launch.simulate import CostModel, long_tail_lengths, simulated_run  # noqa: E402

MAX_NEW = 48


def budget(prompt_id: int) -> int:
    """Long tail: 7 of 8 prompts' responses stop within 4-10 tokens, 1 of 8 run 40-48."""
    rng = np.random.default_rng([prompt_id])
    return int(rng.integers(40, MAX_NEW + 1)) if rng.random() < 0.125 else int(
        rng.integers(4, 11))


class BudgetSampler(Sampler):
    """A Sampler that cuts each request at its budget (a random model has no stop token)."""

    def serve(self, params, *, next_request, **kwargs):
        def budgeted():
            request = next_request()
            if request is None:
                return None
            prompt_id, sample_index, tokens, limit = request
            return prompt_id, sample_index, tokens, min(limit, budget(prompt_id))
        return super().serve(params, next_request=budgeted, **kwargs)


def config(max_staleness: int, steps: int) -> RunConfig:
    return RunConfig(
        name=f"bench_async_k{max_staleness}",
        model=ModelSection(source="random", tokenizer="char", arch=ModelConfig(
            vocab_size=CharTokenizer().vocab_size, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)),
        numerics=NumericalContract(backend="pallas"),
        data=DataSection(num_terms=2, max_operand=99, operators="+-", train_size=512,
                         eval_size=0, user_format="{question}\n"),
        sampling=SamplingParams(max_new_tokens=MAX_NEW, group_size=4, seed=0),
        # DAPO's loss without its shaping: a random model's rewards are all 0, so dynamic
        # sampling would drop every group (and sample three rounds) and leave nothing to train.
        rollout=RolloutSection(prompts_per_step=16, num_slots=8, max_prompt_len=24,
                               steps_per_call=8),
        # No TIS: timing is the point here.
        algorithm=AlgorithmSection(recipe="dapo", dynamic_sampling=False, overlong_buffer=0),
        optimizer=OptimizerConfig(learning_rate=1e-4, total_steps=steps),
        train=TrainSection(steps=steps, mini_batches=1, micro_batches=4, sft_steps=0),
        eval=EvalSection(every=0, greedy=False, sampled=False),
        checkpoint=CheckpointSection(every=0),
        pipeline=PipelineSection(max_staleness=max_staleness, rollout_devices=4,
                                 train_devices=4, interrupt=True),
        metrics=MetricsSection(backends=("jsonl",)),
    )


def measure(max_staleness: int, steps: int, workdir: str) -> dict:
    run = Run(config(max_staleness, steps), workdir, log=lambda *_: None,
              sampler_factory=functools.partial(build_sampler, cls=BudgetSampler))
    run.run(steps=1)          # compile everything (rollout, train step, logprobs) outside the clock
    start = time.perf_counter()
    run.run(steps=steps)
    wall = time.perf_counter() - start
    history = run.history[1:]
    return {
        "step_s": wall / steps,
        "staleness_mean": float(np.mean([h["rollout/staleness_mean"] for h in history])),
        "staleness_max": int(max(h["rollout/staleness_max"] for h in history)),
        "train_idle": float(np.mean([h["time/train_idle_frac"] for h in history])),
        "response_len": float(np.mean([h["rollout/response_len_mean"] for h in history])),
        "dropped": int(sum(h["rollout/dropped_stale"] for h in history)),
        "numerical_abs": float(max(h["mismatch/numerical_abs"] for h in history)),
    }


# ---------------------------------------------------------------------------------------------
# Simulated devices

SIM_MAX_NEW = 64


def simulated_config(max_staleness: int, interrupt: bool, steps: int) -> RunConfig:
    """4 rollout devices x 8 slots, 8 prompts x 8 samples per step, one update per step."""
    base = config(max_staleness, steps)
    return dataclasses.replace(
        base, name=f"simulated_k{max_staleness}_{'interrupt' if interrupt else 'wait'}",
        sampling=base.sampling.replace(max_new_tokens=SIM_MAX_NEW, group_size=8),
        rollout=dataclasses.replace(base.rollout, prompts_per_step=8, num_slots=8),
        pipeline=dataclasses.replace(base.pipeline, interrupt=interrupt))


def measure_simulated(max_staleness: int, interrupt: bool, steps: int, workdir: str,
                      cost: CostModel) -> dict:
    run = simulated_run(simulated_config(max_staleness, interrupt, steps), workdir, cost=cost,
                        lengths=long_tail_lengths(SIM_MAX_NEW), log=lambda *_: None)
    start = time.perf_counter()
    run.run(steps=steps)
    wall = time.perf_counter() - start
    history = run.history
    return {
        # Steady state: the first step of an async run also fills the pipeline (a one-off that
        # a run of hundreds of steps does not notice), so it is left out of both modes.
        "step_s": float(np.mean([h["time/step_s"] for h in history[1:]])),
        "wall_step_s": wall / steps,
        "rollout_s": float(np.mean([h["time/rollout_s"] for h in history])),
        "train_s": float(np.mean([h["time/train_s"] for h in history])),
        "staleness_mean": float(np.mean([h["rollout/staleness_mean"] for h in history])),
        "staleness_max": int(max(h["rollout/staleness_max"] for h in history)),
        "train_idle": float(np.mean([h["time/train_idle_frac"] for h in history])),
        "rollout_idle": float(np.mean([h["time/rollout_idle_frac"] for h in history[1:]])),
        "response_len": float(np.mean([h["rollout/response_len_mean"] for h in history])),
    }


def simulate(steps: int, cost: CostModel) -> None:
    settings = [(0, True)] + [(k, interrupt) for interrupt in (True, False) for k in (1, 2, 4)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, interrupt in settings:
            results[k, interrupt] = measure_simulated(
                k, interrupt, steps, os.path.join(tmp, f"k{k}_{interrupt}"), cost)
    sync = results[0, True]
    print(f"simulated devices: {cost}")
    print(f"sync step: rollout {sync['rollout_s']:.2f} s, train {sync['train_s']:.2f} s "
          f"(rollout / train = {sync['rollout_s'] / sync['train_s']:.1f}); "
          f"mean response {sync['response_len']:.1f} of {SIM_MAX_NEW} tokens")
    print("step_s / speedup: steps 2..N (steady state); with_fill: wall time of all N steps / N")
    print(f"{'mode':<16}{'step_s':>8}{'speedup':>9}{'with_fill':>11}{'train_idle':>12}"
          f"{'rollout_idle':>14}{'staleness':>11}{'stale_max':>11}")
    for (k, interrupt), r in results.items():
        name = "sync (k=0)" if k == 0 else f"k={k} " + ("interrupt" if interrupt else "wait")
        print(f"{name:<16}{r['step_s']:>8.3f}{sync['step_s'] / r['step_s']:>9.2f}"
              f"{sync['wall_step_s'] / r['wall_step_s']:>11.2f}"
              f"{r['train_idle']:>12.2f}{r['rollout_idle']:>14.2f}{r['staleness_mean']:>11.3f}"
              f"{r['staleness_max']:>11d}")
    best = min((key for key in results if key[0] > 0), key=lambda key: results[key]["step_s"])
    print(f"best: k={best[0]} {'interrupt' if best[1] else 'wait'}")
    print(f"speedup={sync['step_s'] / results[best]['step_s']:.2f} "
          f"staleness_mean={results[best]['staleness_mean']:.3f}")


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps per mode (default 8 real, 16 simulated)")
    parser.add_argument("--quick", action="store_true", help="3 steps (simulated: 6)")
    parser.add_argument("--simulate", action="store_true",
                        help="simulated devices (launch/simulate.py) instead of the CPU")
    args = parser.parse_args(argv)
    if args.simulate:
        simulate(6 if args.quick else args.steps or 16, CostModel())
        return
    steps = 3 if args.quick else args.steps or 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (0, 1):
            results[k] = measure(k, steps, os.path.join(tmp, f"k{k}"))
    print(f"{'mode':<14}{'step_s':>8}{'train_idle':>12}{'staleness':>11}{'stale_max':>11}"
          f"{'resp_len':>10}{'dropped':>9}{'num_abs':>9}")
    for k, name in ((0, "sync (k=0)"), (1, "async (k=1)")):
        r = results[k]
        print(f"{name:<14}{r['step_s']:>8.2f}{r['train_idle']:>12.2f}{r['staleness_mean']:>11.3f}"
              f"{r['staleness_max']:>11d}{r['response_len']:>10.1f}{r['dropped']:>9d}"
              f"{r['numerical_abs']:>9.1f}")
    speedup = results[0]["step_s"] / results[1]["step_s"]
    print(f"speedup={speedup:.2f} staleness_mean={results[1]['staleness_mean']:.3f}")


if __name__ == "__main__":
    main()
