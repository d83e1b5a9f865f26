"""The async pipeline across processes: the rollout mesh on one process, the train mesh on another.

Both processes build the same run (jrl.pipeline.runner.Run, not SPMD: model, task, sampler,
trainer, data stream) and each drives only its role's public parts:

  rollout process: RolloutWorker.generate: draws prompts from its stream, samples (admission
                   control as in the single-process run), scores rewards; the batch is packed
                   into fixed-shape arrays;
  train process:   unpacks the arrays into samples and runs the shared RL step
                   (jrl.pipeline.rl_step.RLStep: prepare -> train; the version is held, the
                   weights leave over the link), keeping the last k + 1 versions of the weights.

Transport: JAX collectives over a 2-device mesh ("hosts") made of one device of each process, a
jitted shard_map with a one-way `jax.lax.ppermute` (a copy: the weights arrive bitwise exact; on
CPU the collective runs over gloo). Every process calls the same collectives in the same order,
one lock-step exchange per RL step:

  lag 0 (max_staleness < updates_per_step, the synchronous loop):
      weights v_i train -> rollout; rollout generates batch i; batch i rollout -> train; train.
  lag 1 (max_staleness >= updates_per_step):
      weights v_0 -> rollout; rollout generates batch 0; then for each step i:
      batch i rollout -> train, weights v_i train -> rollout; the rollout process generates batch
      i + 1 with v_i while the train process trains on batch i (token staleness <= U versions).

After the last step the final weights are sent once more, a few times over, to measure the cost
of one weight sync (bytes, seconds) without any wait for the peer in the timing.

Checkpoints: the train process (process 0: Orbax writes host arrays from process 0 only) saves
the same Orbax checkpoint with the same metadata as the single-process Run (train state,
reference, RL step, version, data position, config) every `checkpoint.every` steps, at the end
and on a stop request (SIGINT / SIGTERM to either process: both agree on it at the start of each
step and stop there, jrl.stop_request), into <workdir>/train/checkpoints. With resume=True it restores the newest intact one (or
resume_step) and, in the first exchange, tells the rollout process the step to start at and the
data position; the first weight sync then carries the restored weights and version. A resumed
synchronous run (lag 0) ends bitwise equal to an uninterrupted one. A resumed lag-1 run does
not: the checkpoint holds the weights of its own step s only, while the uninterrupted run
generated batch s with the weights of step s - 1, so the first step after a resume is
generated with the current weights (staleness 0) and the runs part there.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl.metrics import make_writers, names
from jrl.pipeline.batching import pack_rollout
from jrl import stop_request
from jrl.pipeline.config import RunConfig
from jrl.pipeline.rl_step import RLStep, hold_only
from jrl.pipeline.rollout import RolloutBatch
from jrl.sampling import Sample

INFO_BYTES = 1 << 16     # the JSON side channel of a batch (ids, metrics, data state)
ROLLOUT, TRAIN = 0, 1     # the two processes' indices on a HostLink
_BATCH_FIELDS = ("tokens", "attn_mask", "loss_mask", "behavior_logp", "logit_floor", "versions",
                 "rewards", "info")


class HostLink:
    """One-way copies between two processes over a 2-device mesh (one device of each)."""

    def __init__(self, process_a: int, process_b: int):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        self.processes = (process_a, process_b)
        devices = []
        for p in self.processes:
            own = [d for d in jax.devices() if d.process_index == p]
            if not own:
                raise ValueError(f"HostLink: process {p} has no devices")
            devices.append(sorted(own, key=lambda d: d.id)[0])
        self.me = jax.process_index()
        if self.me not in self.processes:
            raise ValueError(f"HostLink: process {self.me} is not one of {self.processes}")
        self.mesh = Mesh(np.array(devices), ("hosts",))
        self.sharding = NamedSharding(self.mesh, P("hosts"))
        self.local_device = devices[self.processes.index(self.me)]
        self._send = {}
        for src in range(2):
            perm = [(src, 1 - src)]
            self._send[src] = jax.jit(jax.shard_map(
                lambda xs, perm=perm: [jax.lax.ppermute(x, "hosts", perm) for x in xs],
                mesh=self.mesh, in_specs=P("hosts"), out_specs=P("hosts")))

    def send(self, leaves: list, *, src: int, like: list | None = None) -> list | None:
        """Process `src` gives `leaves`; the other process gives `like` (arrays of the same shapes
        and dtypes, values ignored). Returns the received leaves on the receiver (on its link
        device), None on the sender. Every participant must call this in the same order."""
        sender = self.me == self.processes[src]
        source = leaves if sender else like
        local = [jax.device_put(jnp.zeros_like(x) if not sender else x, self.local_device)
                 for x in source]
        stacked = [jax.make_array_from_single_device_arrays(
            (2,) + x.shape, self.sharding, [x[None]]) for x in local]
        out = self._send[src](stacked)
        jax.block_until_ready(out)
        if sender:
            return None
        return [x.addressable_shards[0].data[0] for x in out]


def _nbytes(leaves) -> int:
    return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in leaves))


# ----------------------------------------------------------------------------------------------
# Batch <-> fixed-shape arrays


def batch_template(rows: int, seq_len: int) -> list[np.ndarray]:
    """Zero arrays with the shapes and dtypes of an encoded batch (what the receiver gives)."""
    return [np.zeros((rows, seq_len), np.int32), np.zeros((rows, seq_len), np.int32),
            np.zeros((rows, seq_len), np.int32), np.zeros((rows, seq_len), np.float32),
            np.zeros((rows, seq_len), np.float32), np.zeros((rows, seq_len), np.int32),
            np.zeros((rows,), np.float32), np.zeros((INFO_BYTES,), np.uint8)]


def pack_json(obj, what: str = "batch info") -> np.ndarray:
    """obj as JSON in a [INFO_BYTES] uint8 buffer (4-byte length, then the UTF-8 text)."""
    info = json.dumps(obj).encode()
    if len(info) + 4 > INFO_BYTES:
        raise ValueError(f"{what} is {len(info)} bytes, more than {INFO_BYTES - 4}")
    buffer = np.zeros((INFO_BYTES,), np.uint8)
    buffer[:4] = np.frombuffer(np.uint32(len(info)).tobytes(), np.uint8)
    buffer[4:4 + len(info)] = np.frombuffer(info, np.uint8)
    return buffer


def unpack_json(buffer) -> Any:
    buffer = np.asarray(buffer)
    size = int(np.frombuffer(buffer[:4].tobytes(), np.uint32)[0])
    return json.loads(buffer[4:4 + size].tobytes().decode())


def encode_batch(rollout: RolloutBatch, rows: int, seq_len: int) -> list[np.ndarray]:
    packed = pack_rollout(rollout.samples, num_rows=rows, seq_len=seq_len)
    rewards = np.zeros((rows,), np.float32)
    rewards[:len(rollout.samples)] = rollout.rewards
    buffer = pack_json({
        "rl_step": rollout.rl_step, "group_size": rollout.group_size,
        "ids": [[s.prompt_id, s.sample_index, int(s.prompt_tokens.size)]
                for s in rollout.samples],
        "finish": [s.finish_reason for s in rollout.samples],
        "metrics": rollout.metrics, "data_state": rollout.data_state})
    return [packed.tokens, packed.attn_mask.astype(np.int32), packed.loss_mask.astype(np.int32),
            packed.behavior_logp, packed.logit_floor, packed.versions, rewards, buffer]


def decode_batch(arrays: list) -> RolloutBatch:
    tokens, attn, loss, behavior, floor, versions, rewards, buffer = (np.asarray(a)
                                                                      for a in arrays)
    info = unpack_json(buffer)
    samples = []
    for row, ((prompt_id, sample_index, prompt_len), finish) in enumerate(
            zip(info["ids"], info["finish"])):
        end = int(attn[row].sum())
        samples.append(Sample(
            prompt_id=prompt_id, sample_index=sample_index,
            prompt_tokens=tokens[row, :prompt_len].copy(),
            tokens=tokens[row, prompt_len:end].copy(),
            behavior_logp=behavior[row, prompt_len:end].copy(),
            logit_floor=floor[row, prompt_len:end].copy(),
            versions=versions[row, prompt_len:end].copy(), entropy=None, finish_reason=finish,
            # The loss mask is the model-token mask of a multi-turn episode's response.
            model_mask=loss[row, prompt_len:end].astype(bool)))
    return RolloutBatch(rl_step=info["rl_step"], samples=samples, examples=[],
                        rewards=rewards[:len(samples)].copy(), group_size=info["group_size"],
                        data_state=info["data_state"], metrics=info["metrics"])


# ----------------------------------------------------------------------------------------------


def _agree_on_steps(link: HostLink, role: str, run, steps: int | None,
                    log: Callable[[str], None]) -> tuple[int, int, dict]:
    """Where to start and stop: the train process's word (its checkpoint), sent to the rollout
    process, whose stream moves to the same data position. Returns (first step, last step,
    the data state after the prompts of the last step trained)."""
    cfg, info = run.config, None
    if role == "train":
        info = {"start_step": run.start_step,
                "last_step": cfg.train.steps if steps is None else min(cfg.train.steps,
                                                                       run.start_step + steps),
                "data_state": run.stream.state_dict()}
    got = link.send([pack_json(info, "start info")] if role == "train" else None, src=TRAIN,
                    like=[np.zeros((INFO_BYTES,), np.uint8)])
    if role == "rollout":
        info = unpack_json(got[0])
        run.stream.load_state_dict(info["data_state"])
    first, last = info["start_step"], info["last_step"]
    if last <= first:
        log(f"[{role}] already at step {first} of {cfg.train.steps}: nothing to do (raise "
            "train.steps to train further)")
    elif first:
        log(f"[{role}] resuming at step {first}")
    return first, last, info["data_state"]


def run_split_processes(config: RunConfig, workdir: str, *, rollout_process: int = 1,
                        train_process: int = 0, steps: int | None = None, resume: bool = False,
                        resume_step: int | None = None, overwrite: str | None = None,
                        sync_repeats: int = 5, log: Callable[[str], None] = print,
                        **parts) -> dict[str, Any]:
    """Runs RL steps with sampling on `rollout_process` and training on `train_process` (call it
    on both, after jrl.parallel.initialize, with the same arguments); other processes must not
    call it. The train process must be process 0 (it writes the checkpoints; see the module
    docstring). Runs until config.train.steps, or at most `steps` more steps.

    resume / resume_step / overwrite: as for Run, applied to <workdir>/train (the rollout
    process keeps nothing to resume: it starts where the train process tells it). **parts: as
    for Run (e.g. reward_fn).

    Returns, on the train process: {"role": "train", "start_step", "history": [per-step metrics
    incl. train/version, consumed token versions, staleness, mismatch/*, time/*],
    "weights_bytes", "batch_bytes", "params_changed", "weight_sync_s" (median of sync_repeats
    back-to-back syncs), "params": final params (host)}; on the rollout process: {"role":
    "rollout", "start_step", "generated": [(step, version used)], "params": the final weights
    as received}.
    """
    from jrl.pipeline.runner import Run

    cfg = config
    if jax.process_count() < 2:
        raise ValueError("--split-processes needs two processes (one trains, one samples), "
                         "started with jax.distributed: use jrl/cli/local_cluster.py or a cluster "
                         "launcher; this is a single process")
    me = jax.process_index()
    role = "rollout" if me == rollout_process else "train" if me == train_process else None
    if role is None:
        raise ValueError(f"process {me} is neither the rollout ({rollout_process}) nor the "
                         f"train ({train_process}) process")
    if train_process != 0:
        raise ValueError(f"run_split_processes: train_process={train_process}; the train "
                         "process must be process 0, the one that can write checkpoints alone")
    link = HostLink(rollout_process, train_process)
    # The rollout process builds the parts only: it writes nothing, so it claims nothing.
    run = Run(cfg, os.path.join(workdir, role), resume=resume and role == "train",
              resume_step=resume_step if role == "train" else None,
              overwrite=overwrite if role == "train" else None, log=log, write_metrics=False,
              spmd=False, claim=role == "train", devices=jax.local_devices(), **parts)
    trainer, worker = run.trainer, run.worker
    if len(worker.samplers) != 1 or trainer.mesh is not None:
        run.close()
        raise ValueError("run_split_processes supports one rollout and one train device per "
                         "process: set pipeline.rollout_devices = pipeline.train_devices = 0 "
                         f"(got {cfg.pipeline.rollout_devices} and {cfg.pipeline.train_devices})")
    k, lag = cfg.pipeline.max_staleness, int(cfg.pipeline.max_staleness >= trainer.updates_per_step)
    param_leaves, treedef = jax.tree.flatten(trainer.state.params)
    like_params = [np.zeros(x.shape, x.dtype) for x in param_leaves]
    like_batch = batch_template(trainer.rows, trainer.seq_len)

    # The first collective comes before any long local work (the warm start): a peer that
    # waits past the collectives' setup timeout (30 s on CPU) fails instead of waiting.
    first, last, data_state = _agree_on_steps(link, role, run, steps, log)

    def either_signal(signum: int) -> int:
        """This process's stop signal, else the peer's (0: neither): one scalar each way."""
        mine = np.asarray(signum, np.int32)
        from_train = link.send([mine] if role == "train" else None, src=TRAIN,
                               like=[np.zeros((), np.int32)])
        from_rollout = link.send([mine] if role == "rollout" else None, src=ROLLOUT,
                                 like=[np.zeros((), np.int32)])
        return signum or int(np.asarray((from_train or from_rollout)[0]))

    # Both processes stop at the same step boundary, so neither waits in a collective alone.
    stop_request.agree_with(either_signal)
    resumed = role == "train" and run.resumed_from is not None
    if role == "train" and not resumed:
        run.start_policy()
    step = RLStep(trainer, publish=hold_only)
    if role == "train":
        hold_only(trainer)          # the weights of the first sync are held for rescoring
    initial = jax.device_get(trainer.state.params)
    timing: dict[str, list] = {"weights": [], "batch": []}

    def sync_weights():
        """train -> rollout: the train process's current params. Returns (params, version) on
        the rollout process."""
        start = time.perf_counter()
        leaves = jax.tree.leaves(trainer.state.params) if role == "train" else None
        got = link.send(leaves, src=TRAIN, like=like_params)
        version = link.send([np.asarray(trainer.state.version, np.int32)] if role == "train"
                            else None, src=TRAIN, like=[np.zeros((), np.int32)])
        timing["weights"].append(time.perf_counter() - start)
        if role == "rollout":
            return jax.tree.unflatten(treedef, got), int(np.asarray(version[0]))
        return None, None

    def sync_batch(rollout: RolloutBatch | None):
        start = time.perf_counter()
        arrays = encode_batch(rollout, trainer.rows, trainer.seq_len) if role == "rollout" \
            else None
        got = link.send(arrays, src=ROLLOUT, like=like_batch)
        timing["batch"].append(time.perf_counter() - start)
        return decode_batch(got) if role == "train" else None

    generated: list[tuple[int, int]] = []

    def generate(rl_step, params, version):
        generated.append((rl_step, version))
        start = time.perf_counter()
        batch = worker.generate(rl_step, params, version)
        batch.metrics[names.TIME_GENERATE_S] = time.perf_counter() - start
        return batch

    history: list[dict] = []

    def train(rollout: RolloutBatch, rl_step: int) -> None:
        nonlocal data_state
        if rollout.rl_step != rl_step:
            raise RuntimeError(f"the rollout process sent step {rollout.rl_step}'s batch for "
                               f"step {rl_step}")
        result = step(rollout)
        consumed = result.consumed
        metrics = {"step": rl_step + 1, **result.metrics,
                   "consumed/trainer_version": result.version_in,
                   "consumed/token_versions": consumed["token_versions"],
                   names.TIME_BATCH_EXCHANGE_S: timing["batch"][-1]}
        history.append(metrics)
        if writer is not None:
            writer.write(rl_step + 1, {name: value for name, value in metrics.items()
                                       if isinstance(value, (int, float)) and name != "step"})
        log(f"[train] step {rl_step + 1}: version {result.version_out}, token versions "
            f"{consumed['token_versions']}, staleness max {metrics[names.ROLLOUT_STALENESS_MAX]}, "
            f"mismatch max {metrics[names.MISMATCH_LOGPROB_ABS_DIFF_MAX]}")
        data_state = result.data_state
        done = rl_step + 1
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != last:
            run.save_checkpoint(done, data_state)

    # The train process holds every metric: it writes <workdir>/train/metrics.jsonl (a resumed
    # run first drops the records past its checkpoint).
    writer = make_writers(os.path.join(workdir, role), tensorboard=False,
                          resume_step=first if resumed else None) if role == "train" else None
    pending: RolloutBatch | None = None
    run_start = time.perf_counter()
    done = first      # the last step the train process finished
    try:
        if lag == 0:
            for i in range(first, last):
                stop_request.check_stop_at_step()
                params, version = sync_weights()
                if role == "rollout":
                    pending = generate(i, params, version)
                rollout = sync_batch(pending)
                if role == "train":
                    train(rollout, i)
                    done = i + 1
                    history[-1][names.TIME_WEIGHT_EXCHANGE_S] = timing["weights"][-1]
        else:
            params, version = sync_weights()
            if role == "rollout" and last > first:
                pending = generate(first, params, version)
            for i in range(first, last):
                stop_request.check_stop_at_step()
                rollout = sync_batch(pending)
                if i + 1 < last:
                    params, version = sync_weights()
                    if role == "rollout":
                        pending = generate(i + 1, params, version)
                if role == "train":
                    train(rollout, i)
                    done = i + 1
                    history[-1][names.TIME_WEIGHT_EXCHANGE_S] = timing["weights"][-1]
    except KeyboardInterrupt:
        stop_request.agree_with(None)
        if writer is not None:
            writer.close()
        if role == "train" and done > first and run.saved_step != done:
            log(f"\ninterrupted: saving step {done} and stopping")
            run.save_checkpoint(done, data_state)
        elif role == "train":
            log("\ninterrupted: " + (f"step {done} is saved; stopping" if done > first
                                      else f"before step {done + 1} finished: nothing new to "
                                      "save"))
        run.close()
        raise
    stop_request.agree_with(None)
    total = time.perf_counter() - run_start
    if writer is not None:
        writer.close()
    if role == "train" and last > first:
        run.save_checkpoint(last, data_state)
    run.close()

    # The cost of one weight sync, back to back (no waiting for the peer inside the timing).
    timing["weights"].clear()
    final = None
    for _ in range(max(sync_repeats, 1)):
        final, _ = sync_weights()
    result: dict[str, Any] = {
        "role": role, "start_step": first, "steps": last, "lag": lag, "max_staleness": k,
        "total_s": total,
        "weights_bytes": _nbytes(like_params), "batch_bytes": _nbytes(like_batch),
        "weight_sync_s": statistics.median(timing["weights"]),
        "weight_sync_all_s": list(timing["weights"])}
    if role == "rollout":
        result["generated"] = generated
        result["params"] = jax.device_get(final)
    else:
        result["history"] = history
        result["params"] = jax.device_get(trainer.state.params)
        result["params_changed"] = any(
            np.asarray(a).tobytes() != np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(result["params"])))
    log(f"[{role}] {last - first} steps in {total:.1f}s; weight sync "
        f"{result['weights_bytes'] / 1e6:.3f} MB in {result['weight_sync_s'] * 1e3:.2f} ms "
        f"(median of {len(timing['weights'])})")
    return result
