"""A split run's two sides put together: the train process's Run with the host link as its
rollout source, and the rollout process's server (jrl.pipeline.loop.multihost has both halves and the
transport; jrl.pipeline.loop.runner the one run loop)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from jrl import logs, paths
from jrl.pipeline.config import RunConfig
from jrl.pipeline.loop.multihost import LinkSource, RolloutServer, nbytes, split_sides, stream_lag
from jrl.pipeline.setup.parts import build_parts
from jrl.pipeline.loop.runner import Run


def split_processes(config: RunConfig, workdir: str, *, rollout_process: int = 1,
                    train_process: int = 0, resume: bool = False,
                    resume_step: int | None = None, overwrite: str | None = None,
                    profile_steps: tuple[int, int] | None = None,
                    log: Callable[[str], None] = logs.info, **parts):
    """This process's side of a split run (call it on both, after jrl.parallel.initialize, with
    the same arguments; other processes must not call it).

    On the train process (process 0: it writes the checkpoints alone): a Run over
    <workdir>/train whose rollout source is the link (LinkSource), used as any Run: run.run()
    (one call), config.json, evaluation, checkpoints, resume, Ctrl-C save, progress bar;
    resume / resume_step / overwrite / profile_steps apply to it. On the rollout process: a RolloutServer
    (server.serve()); it keeps nothing to resume and starts where the train process tells it.
    **parts: build_parts' keywords (e.g. reward_fn).
    """
    link, role = split_sides(rollout_process, train_process)
    if role == "train":
        return Run(config, os.path.join(workdir, "train"), resume=resume,
                   resume_step=resume_step, overwrite=overwrite, log=log, spmd=False,
                   profile_steps=profile_steps,
                   devices=jax.local_devices(), source=lambda p: LinkSource(link, p), **parts)
    # The same parts as the train process's Run (its resolved contract), on this process's
    # devices; the rollout process writes nothing, so it claims nothing.
    config = dataclasses.replace(config, numerics=config.numerics.resolved_for())
    rollout_dir = os.path.join(workdir, "rollout")
    paths.makedirs(paths.resolve(rollout_dir))
    return RolloutServer(link, build_parts(config, devices=jax.local_devices(), log=log,
                                           **parts), log=log)


def run_split_processes(config: RunConfig, workdir: str, *, rollout_process: int = 1,
                        train_process: int = 0, steps: int | None = None, resume: bool = False,
                        resume_step: int | None = None, overwrite: str | None = None,
                        sync_repeats: int = 5, log: Callable[[str], None] = logs.info,
                        **parts) -> dict[str, Any]:
    """split_processes, run to the end, then the cost of one weight sync measured over
    `sync_repeats` back-to-back syncs (tests and benchmarks). Runs until config.train.steps, or
    at most `steps` more steps.

    Returns, on the train process: {"role": "train", "start_step", "history": [per-step metrics
    incl. train/version, consumed/trainer_version, consumed/token_versions, staleness,
    mismatch/*, time/*], "weights_bytes", "batch_bytes", "params_changed", "weight_sync_s"
    (median of sync_repeats back-to-back syncs), "params": final params (host)}; on the rollout
    process: {"role": "rollout", "start_step", "generated": [(step, version used)], "params":
    the final weights as received}.
    """
    side = split_processes(config, workdir, rollout_process=rollout_process,
                           train_process=train_process, resume=resume, resume_step=resume_step,
                           overwrite=overwrite, log=log, **parts)
    run_start = time.perf_counter()
    if isinstance(side, RolloutServer):
        trainer, wire = side.parts.trainer, side.wire
        side.serve()
        first, last = side.start_step, side.last_step
    else:
        trainer, wire = side.trainer, side.source.wire
        initial = jax.device_get(trainer.state.params)
        first = side.start_step
        try:
            side.run(steps=steps)
        finally:
            side.close()
        last = side.start_step
    total = time.perf_counter() - run_start
    final = wire.measure_weight_sync(trainer, sync_repeats)
    lag = stream_lag(config, trainer)
    result: dict[str, Any] = {
        "role": wire.role, "start_step": first, "steps": last, "lag": lag,
        "max_staleness": config.pipeline.max_staleness, "total_s": total,
        "weights_bytes": nbytes(wire.like_params), "batch_bytes": nbytes(wire.like_batch),
        "weight_sync_s": statistics.median(wire.timing["weights"]),
        "weight_sync_all_s": list(wire.timing["weights"])}
    if wire.role == "rollout":
        result["generated"] = side.generated
        result["params"] = jax.device_get(final)
    else:
        result["history"] = [
            {**h, "consumed/trainer_version": c["trainer_version"],
             "consumed/token_versions": c["token_versions"]}
            for h, c in zip(side.history, side.consumed)]
        result["params"] = jax.device_get(trainer.state.params)
        result["params_changed"] = any(
            np.asarray(a).tobytes() != np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(result["params"])))
    log(f"[{wire.role}] {last - first} steps in {total:.1f}s; weight sync "
        f"{result['weights_bytes'] / 1e6:.3f} MB in {result['weight_sync_s'] * 1e3:.2f} ms "
        f"(median of {len(wire.timing['weights'])})")
    return result
