"""The RL run: public parts (jrl.pipeline.setup.parts) wired into a loop, with checkpoints and evals.

Each RL step, in the main thread: `rollout = source.next_batch()`, then `step(rollout)`
(prepare -> train -> publish to the source, jrl.pipeline.training.rl_step). This is the only loop: a mode
is its rollout source (jrl.pipeline.loop.sources), the transport between rollout and training:
in-process sampler threads (jrl.pipeline.rollout.worker), every process's share gathered (SPMD,
jrl.pipeline.loop.spmd), or batches from a rollout process over a host link (split processes,
jrl.pipeline.loop.multihost). One code path serves synchronous and asynchronous training: step i's
batch is generated as soon as admission lets it (weights at most max_staleness versions behind
the version that consumes it); max_staleness = 0 is exactly the synchronous loop. The weights
published after RL step i have version (i + 1) * updates_per_step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax

from jrl import logs, paths
from jrl.metrics import ProgressBar, make_writers, names
from jrl.pipeline.config import RunConfig
from jrl.pipeline.config.tools import to_dict
from jrl.pipeline.loop.evaluation import evaluate
from jrl.pipeline.loop.faults import (NonFiniteError, check_finite, interrupts_deferred,
                                 reward_error_warning)
from jrl.pipeline.setup.parts import RunParts, build_parts
from jrl.pipeline.loop.resume import resume_from_checkpoint, save_checkpoint
from jrl.pipeline.training.rl_step import RLStep
from jrl.pipeline.loop.sources import InProcessSource, RolloutSource
from jrl.pipeline.loop.spmd import GatheredSource
from jrl.pipeline.loop.summary import run_summary, write_summary
from jrl import stop_request
from jrl.pipeline.loop.warm_start import start_policy
from jrl.pipeline.loop.workdir import check_run_paths, claim_workdir
from jrl.train import TrainState

__all__ = ["NonFiniteError", "Run", "RunResult"]


@dataclasses.dataclass
class RunResult:
    state: TrainState
    history: list[dict]
    final_eval: dict
    workdir: str


class Run:
    """A run: its parts built from the config (build_parts), then `run()`.

    The config's numerical contract is resolved for the platform first (the platform's tiles
    for every tile left at the class default, NumericalContract.resolved_for): run.config is
    what runs, and what config.json and the checkpoints record.

    workdir holds checkpoints/, metrics.jsonl and config.json: a local path (made absolute) or
    a gs:// URL, kept as it is (jrl.paths; jrl.pipeline.loop.workdir says what a URL workdir does not
    guarantee). resume=True continues from the
    latest intact checkpoint (resume_step: a given one); a workdir that already holds a run is
    refused unless resume or overwrite ("move" it aside or "delete" it; jrl.pipeline.loop.workdir).
    spmd: one run over every process (default when there are several). claim=False: build the
    parts only and write nothing. profile_steps=(a, b): a jax.profiler trace of RL steps a to b
    (1-based, inclusive) in workdir/profile. source(parts) -> RolloutSource: where the loop
    gets its batches (jrl.pipeline.loop.sources; default: this process's sampler threads, gathered
    across processes with SPMD). **parts: build_parts' keywords (devices, task, reward_fn,
    raise_reward_errors, sampler_factory, trainer_factory, worker_factory). The parts stay
    public: run.parts (RunParts), run.task, run.trainer, run.worker, run.source, run.step (the
    RLStep).
    """

    def __init__(self, config: RunConfig, workdir: str, *, resume: bool = False,
                 resume_step: int | None = None, overwrite: str | None = None,
                 log: Callable[[str], None] = logs.info, write_metrics: bool = True,
                 spmd: bool | None = None, claim: bool = True,
                 profile_steps: tuple[int, int] | None = None,
                 source: Callable[[RunParts], RolloutSource] | None = None, **parts):
        # The platform's tiles unless the config names its platform (NumericalContract.
        # resolved_for); config.json and the checkpoints record the resolved contract.
        config = dataclasses.replace(config, numerics=config.numerics.resolved_for())
        self.config = config
        check_run_paths(config, workdir)
        self.workdir, self.log = paths.resolve(workdir), log
        self.multi = jax.process_count() > 1 if spmd is None else spmd
        # metrics, config.json, the workdir's marker and lock: one process writes them.
        self._writes_files = claim and (not self.multi or jax.process_index() == 0)
        # A run never replaces another one's files unless told to, and holds its workdir's
        # lock until close() (jrl.pipeline.loop.workdir).
        resuming = resume or resume_step is not None
        self._claim = claim_workdir(self.workdir, resume=resuming, overwrite=overwrite,
                                    name=config.name, act=self._writes_files, log=log)
        try:
            paths.makedirs(self.workdir)
            self.parts: RunParts = build_parts(
                config, multi=self.multi,
                checkpoint_dir=os.path.join(self.workdir, "checkpoints"), log=log, **parts)
            p = self.parts
            self.task, self.trainer, self.worker, self.stream = p.task, p.trainer, p.worker, \
                p.stream
            self.source: RolloutSource = source(p) if source is not None else (
                GatheredSource if self.multi else InProcessSource)(self.worker)
            self.step = RLStep(self.trainer, publish=self.source.publish)
            self.profile_steps, self._tracing = profile_steps, False
            self.history: list[dict] = []
            self.summary: dict | None = None   # summary.json's record, once run() returns
            self.consumed: list[dict] = []    # per RL step: the versions the trainer consumed
            self._write_metrics, self._started = write_metrics, False
            self.saved_step: int | None = None    # the step this Run last wrote a checkpoint of
            # Resume now, so that a checkpoint that does not fit this config is a setup error.
            self.resumed_from = resume_from_checkpoint(
                self.trainer, self.stream, config, resume_step=resume_step,
                set_aside=self._writes_files, log=log) if resuming else None
            self.start_step = self.resumed_from or 0
            if self.source.agree is not None:
                stop_request.agree_with(self.source.agree)
        except BaseException:
            self._claim.release()
            raise
        for line in p.describe().splitlines():
            log(line)

    def start_policy(self) -> None:
        """A fresh run's starting policy (jrl.pipeline.loop.warm_start.start_policy): warm start,
        then the frozen reference; several processes each run the SFT on a local device."""
        start_policy(self.trainer, self.config, self.parts.train_examples, task=self.task,
                     device=self.parts.rollout_devices[0] if self.multi else None, log=self.log)

    def evaluate(self) -> dict:
        """Greedy (and sampled) accuracy on the held-out prompts with the current weights."""
        cfg, trainer, p = self.config, self.trainer, self.parts
        if not p.eval_examples:
            return {}
        params = jax.device_put(trainer.params_on_host() if self.multi else trainer.state.params,
                                p.rollout_devices[0])
        return evaluate(params, p.eval_examples, task=self.task, version=trainer.version,
                        greedy=p.eval_sampler if cfg.eval.greedy else None,
                        sampled=p.samplers[0] if cfg.eval.sampled else None)

    def save_checkpoint(self, rl_step: int, data_state: dict) -> None:
        """Checkpoint rl_step (jrl.pipeline.loop.resume.save_checkpoint). An interrupt during the
        write is raised once saved_step names it (so the handler does not save it again)."""
        with interrupts_deferred():
            save_checkpoint(self.trainer, self.config, rl_step, data_state, log=self.log)
            self.saved_step = rl_step

    # ------------------------------------------------------------------------------------------
    # The loop

    def _open_writer(self, *, fresh: bool):
        if not self._write_metrics:
            return None
        return make_writers(self.workdir,
                            tensorboard=self.config.metrics.tensorboard,
                            is_main_process=self._writes_files,
                            resume_step=None if fresh else self.start_step,
                            wandb=self.config.metrics.wandb, run_name=self.config.name,
                            run_config=to_dict(self.config))

    def _profile(self, step: int | None, *, starting: bool) -> None:
        """Starts the jax.profiler trace before the first profiled step and stops it after the
        last (step None: stop now, the loop is leaving)."""
        if self.profile_steps is None:
            return
        first, last = self.profile_steps
        directory = os.path.join(self.workdir, "profile")
        if starting and step == first and not self._tracing:
            jax.profiler.start_trace(directory)
            self._tracing = True
        elif not starting and self._tracing and (step is None or step == last):
            jax.profiler.stop_trace()
            self._tracing = False
            until = f"step {last}" if step is not None else "the stop"
            self.log(f"profile: RL steps {first} to {until} traced to {directory} "
                     "(TensorBoard's profile plugin, or Perfetto with its trace.json.gz)")

    def _begin(self) -> tuple[object, dict]:
        """First call of run(): the starting policy unless resumed, config.json, the step-0
        eval. Returns (writer, eval)."""
        self._started = True
        fresh = self.resumed_from is None
        if fresh:
            self.start_policy()
        writer = self._open_writer(fresh=fresh)
        if self._writes_files:
            with paths.open_file(os.path.join(self.workdir, "config.json"), "w") as f:
                json.dump(to_dict(self.config), f, indent=1)
        first_eval = self.evaluate() if fresh else {}
        if first_eval:
            self.log("eval at step 0: " + ", ".join(f"{k}={v:.3f}" for k, v in first_eval.items()))
            if writer is not None:
                writer.write(0, first_eval)
        return writer, first_eval

    def _step(self, rl_step: int) -> tuple[dict, dict]:
        """One RL step: wait for its batch, then the RL step (jrl.pipeline.training.rl_step). Returns
        (metrics, data state after its prompts)."""
        start = time.perf_counter()
        rollout = self.source.next_batch()
        wait = time.perf_counter() - start
        if rollout.rl_step != rl_step:
            raise RuntimeError(f"the rollout source gave step {rollout.rl_step}'s batch for "
                               f"step {rl_step}")
        warning = reward_error_warning(rl_step, rollout.metrics, self.trainer.rows,
                                       rollout.first_reward_error)
        if warning:
            self.log(warning)
        result = self.step(rollout)
        self.consumed.append(result.consumed)
        metrics = result.metrics
        metrics[names.TIME_WAIT_S] = wait
        metrics[names.TIME_STEP_S] = time.perf_counter() - start
        metrics[names.TIME_TRAIN_IDLE_FRAC] = wait / max(metrics[names.TIME_STEP_S], 1e-9)
        metrics.update(self.source.step_metrics())
        check_finite(rl_step + 1, metrics)
        return metrics, result.data_state

    def run(self, *, steps: int | None = None) -> RunResult:
        """Trains until config.train.steps RL steps (or `steps` more) are done.

        May be called again to continue (e.g. run(steps=1) to compile, then run()).
        """
        self._claim.acquire()    # the workdir is this run's while it trains
        try:
            return self._run(steps)
        finally:
            self._claim.release()

    def _run(self, steps: int | None) -> RunResult:
        cfg = self.config
        last_step = cfg.train.steps if steps is None else min(cfg.train.steps,
                                                              self.start_step + steps)
        self.source.begin(self.start_step, last_step)
        writer, final_eval = self._begin() if not self._started else (
            self._open_writer(fresh=False), {})
        if last_step <= self.start_step:
            self.log(f"already at step {self.start_step} of {cfg.train.steps}: nothing to do "
                     "(raise train.steps to train further)")
            if writer is not None:
                writer.close()
            return RunResult(self.trainer.state, self.history, final_eval, self.workdir)
        self.step.publish(self.trainer)      # the weights the first batch is sampled with
        progress = ProgressBar(last_step)
        run_start = time.perf_counter()
        # The last finished step, its data position and its train state: an interrupt saves
        # these together, never the state of a step cut short (its update may already be in
        # trainer.state while its metrics and data position are not).
        last_done, data_state, committed = (self.start_step, self.stream.state_dict(),
                                            self.trainer.state)
        self.source.start(self.start_step, last_step)

        def save(step: int, state: dict) -> None:
            if writer is not None:
                writer.flush()   # a URL's metrics.jsonl is uploaded: a resume finds the records
            self.save_checkpoint(step, state)

        try:
            for rl_step in range(self.start_step, last_step):
                # A SIGINT / SIGTERM since the last step (jrl.stop_request; several processes
                # agree on it, so that they stop at the same step).
                stop_request.check_stop_at_step()
                self._profile(rl_step + 1, starting=True)
                metrics, step_data_state = self._step(rl_step)
                done = rl_step + 1
                self._profile(done, starting=False)
                if cfg.eval.every and done % cfg.eval.every == 0 or done == last_step:
                    final_eval = self.evaluate()
                    metrics.update(final_eval)
                if writer is not None:
                    writer.write(done, metrics)
                self.history.append({"step": done, **metrics})
                progress.update(done, metrics)
                last_done, data_state, committed = done, step_data_state, self.trainer.state
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 \
                        and done != last_step:
                    save(done, data_state)
            stop_request.check_stop_at_step()
            save(last_done, data_state)
        except KeyboardInterrupt:
            # Back to the last finished step, so that this Run (and a checkpoint) is consistent.
            self.trainer.state = committed
            if last_done > self.start_step and self.saved_step == last_done:
                self.log(f"\ninterrupted: step {last_done} is saved; stopping")
            elif last_done > self.start_step:
                self.log(f"\ninterrupted: saving step {last_done} and stopping")
                save(last_done, data_state)
            else:
                self.log(f"\ninterrupted before step {last_done + 1} finished: nothing new to "
                         "save")
            self.start_step = last_done
            self.stream.load_state_dict(data_state)
            raise
        finally:
            if self._tracing:
                self._profile(None, starting=False)
            self.source.stop()
            progress.close()
            if writer is not None:
                writer.close()
        wall_s = time.perf_counter() - run_start
        self.log(f"done: {last_done - self.start_step} steps in {wall_s:.1f}s")
        if self._writes_files:
            self.summary = run_summary(cfg, os.path.join(self.workdir, "metrics.jsonl"),
                                       steps=last_done, wall_s=wall_s,
                                       model_type=self.trainer.model_config.model_type)
            write_summary(self.workdir, self.summary)
        self.start_step = last_done
        return RunResult(self.trainer.state, self.history, final_eval, self.workdir)

    def close(self) -> None:
        """Stops the rollout threads, closes the checkpoint manager and releases the workdir
        (`with Run(...) as run:` does it on exit)."""
        if self.source.agree is not None:
            stop_request.agree_with(None)
        try:
            self.source.stop()
            self.worker.stop()
            self.trainer.close()
        finally:
            self._claim.release()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
