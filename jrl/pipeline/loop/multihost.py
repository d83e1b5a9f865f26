"""The async pipeline across processes: the rollout mesh on one process, the train mesh on another.

The train process runs the one run loop (jrl.pipeline.loop.runner.Run) with the link as its rollout
source (LinkSource, jrl.pipeline.loop.sources); the rollout process is a short server over the link
(RolloutServer). This module sits beside the run loop, not above it: jrl.pipeline.loop.split_run
puts the two together (split_processes, run_split_processes). Both build the same parts (jrl.pipeline.setup.parts.build_parts, not SPMD: model,
task, samplers, trainer, data stream) and use only their role's:

  rollout process: RolloutWorker.generate: draws prompts from its stream, samples (admission
                   control as in the single-process run), scores rewards; the batch is packed
                   into fixed-shape arrays;
  train process:   Run: unpacks the arrays into samples and runs the shared RL step
                   (jrl.pipeline.training.rl_step.RLStep: prepare -> train; the version is held, the
                   weights leave over the link), keeping the last k + 1 versions of the weights;
                   config.json, evaluation, metrics, the non-finite stop, the progress bar and
                   the checkpoints are Run's own.

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

The first exchange (LinkSource.begin, at the start of Run.run) tells the rollout process the
steps and the data position; at each step boundary both exchange their stop signal
(jrl.stop_request.agree_with). run_split_processes then sends the final weights a few times
over, to measure the cost of one weight sync (bytes, seconds) without any wait for the peer in
the timing.

Checkpoints: the train process (process 0: Orbax writes host arrays from process 0 only) saves
the same Orbax checkpoint with the same metadata as the single-process Run (train state,
reference, RL step, version, data position, config) every `checkpoint.every` steps, at the end
and on a stop request (SIGINT / SIGTERM to either process: both agree on it at the start of each
step and stop there, jrl.stop_request), into <workdir>/train/checkpoints. With resume=True it
restores the newest intact one (or resume_step) and, in the first exchange, tells the rollout process the step to start at and the
data position; the first weight sync then carries the restored weights and version. A resumed
synchronous run (lag 0) ends bitwise equal to an uninterrupted one. A resumed lag-1 run does
not: the checkpoint holds the weights of its own step s only, while the uninterrupted run
generated batch s with the weights of step s - 1, so the first step after a resume is
generated with the current weights (staleness 0) and the runs part there.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl.metrics import names
from jrl.pipeline.training.batching import pack_rollout
from jrl import logs, stop_request
from jrl.pipeline.config import RunConfig
from jrl.pipeline.training.rl_step import hold_only
from jrl.pipeline.rollout.batch import RolloutBatch
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


def nbytes(leaves) -> int:
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
        "metrics": rollout.metrics, "data_state": rollout.data_state,
        "first_reward_error": rollout.first_reward_error})
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
                        data_state=info["data_state"], metrics=info["metrics"],
                        first_reward_error=info.get("first_reward_error"))


# ----------------------------------------------------------------------------------------------
# The train side: a rollout source of Run's loop


def split_sides(rollout_process: int, train_process: int) -> tuple[HostLink, str]:
    """The link and this process's role; ValueError when the processes do not fit."""
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
        raise ValueError(f"split processes: train_process={train_process}; the train process "
                         "must be process 0, the one that can write checkpoints alone")
    return HostLink(rollout_process, train_process), role


def _check_one_device_each(cfg: RunConfig, parts) -> None:
    if len(parts.worker.samplers) != 1 or parts.trainer.mesh is not None:
        raise ValueError("split processes support one rollout and one train device per "
                         "process: set pipeline.rollout_devices = pipeline.train_devices = 0 "
                         f"(got {cfg.pipeline.rollout_devices} and {cfg.pipeline.train_devices})")


def stream_lag(cfg: RunConfig, trainer) -> int:
    """1 when the rollout process may generate step i + 1 while step i trains (module
    docstring), else 0."""
    return int(cfg.pipeline.max_staleness >= trainer.updates_per_step)


class _Wire:
    """The exchanges of one side of the link, in the order both sides call them; each side
    gives its own values and a template of the other's (shapes and dtypes)."""

    def __init__(self, link: HostLink, role: str, trainer):
        self.link, self.role = link, role
        leaves, self.treedef = jax.tree.flatten(trainer.state.params)
        self.like_params = [np.zeros(x.shape, x.dtype) for x in leaves]
        self.rows, self.seq_len = trainer.rows, trainer.seq_len
        self.like_batch = batch_template(self.rows, self.seq_len)
        self.timing: dict[str, list[float]] = {"weights": [], "batch": []}

    def start_info(self, info: dict | None) -> dict:
        """train -> rollout: where to start and stop (the train process's word)."""
        got = self.link.send([pack_json(info, "start info")] if self.role == "train" else None,
                             src=TRAIN, like=[np.zeros((INFO_BYTES,), np.uint8)])
        return info if self.role == "train" else unpack_json(got[0])

    def either_signal(self, signum: int) -> int:
        """This process's stop signal, else the peer's (0: neither): one scalar each way
        (jrl.stop_request.agree_with)."""
        mine, like = np.asarray(signum, np.int32), [np.zeros((), np.int32)]
        from_train = self.link.send([mine] if self.role == "train" else None, src=TRAIN,
                                    like=like)
        from_rollout = self.link.send([mine] if self.role == "rollout" else None, src=ROLLOUT,
                                      like=like)
        return signum or int(np.asarray((from_train or from_rollout)[0]))

    def weights(self, trainer=None) -> tuple[Any, int | None]:
        """train -> rollout: the trainer's current params and version. Returns (params,
        version) on the rollout process, (None, None) on the train process."""
        start = time.perf_counter()
        train = self.role == "train"
        got = self.link.send(jax.tree.leaves(trainer.state.params) if train else None,
                             src=TRAIN, like=self.like_params)
        version = self.link.send([np.asarray(trainer.state.version, np.int32)] if train
                                 else None, src=TRAIN, like=[np.zeros((), np.int32)])
        self.timing["weights"].append(time.perf_counter() - start)
        if train:
            return None, None
        return jax.tree.unflatten(self.treedef, got), int(np.asarray(version[0]))

    def batch(self, rollout: RolloutBatch | None = None) -> RolloutBatch | None:
        """rollout -> train: one step's batch. Returns it on the train process."""
        start = time.perf_counter()
        arrays = encode_batch(rollout, self.rows, self.seq_len) if self.role == "rollout" \
            else None
        got = self.link.send(arrays, src=ROLLOUT, like=self.like_batch)
        self.timing["batch"].append(time.perf_counter() - start)
        return decode_batch(got) if self.role == "train" else None

    def measure_weight_sync(self, trainer, repeats: int) -> Any:
        """The cost of one weight sync, back to back (no waiting for the peer inside the
        timing): timing["weights"] holds the `repeats` times after. Returns the last params
        received (rollout process)."""
        self.timing["weights"].clear()
        final = None
        for _ in range(max(repeats, 1)):
            final, _ = self.weights(trainer)
        return final


class LinkSource:
    """Run's rollout source on the train process of a split run: each step's batch is received
    from the rollout process (RolloutServer) and the weights are sent to it, in the lock-step
    order of the module docstring. Publishing only holds the version (hold_only): the weights
    leave when the next exchange asks for them."""

    def __init__(self, link: HostLink, parts):
        _check_one_device_each(parts.config, parts)
        self.parts, self.trainer, self.lag = parts, parts.trainer, stream_lag(parts.config,
                                                                        parts.trainer)
        self.wire = _Wire(link, "train", parts.trainer)
        self.agree = self.wire.either_signal
        self._began = False
        self._next = self._first = self._last = 0

    def publish(self, trainer) -> Any:
        return hold_only(trainer)

    def begin(self, first_step: int, last_step: int) -> None:
        """Tells the rollout process the steps and the data position (the first exchange,
        before any long local work: a peer that waits past the collectives' setup timeout, 30 s
        on CPU, fails instead of waiting)."""
        if self._began:
            raise RuntimeError("a split-process run trains in one run() call; start the "
                               "processes again (with --resume) to train further")
        self._began = True
        self.wire.start_info({"start_step": first_step, "last_step": last_step,
                              "data_state": self.parts.stream.state_dict()})

    def start(self, first_step: int, last_step: int) -> None:
        self._next, self._first, self._last = first_step, first_step, last_step

    def next_batch(self) -> RolloutBatch:
        i = self._next
        self._next += 1
        if self.lag == 0 or i == self._first:
            self.wire.weights(self.trainer)
        rollout = self.wire.batch()
        if self.lag == 1 and i + 1 < self._last:
            self.wire.weights(self.trainer)    # step i + 1 is generated while step i trains
        return rollout

    def step_metrics(self) -> dict:
        timing = self.wire.timing
        return {names.TIME_BATCH_EXCHANGE_S: timing["batch"][-1],
                names.TIME_WEIGHT_EXCHANGE_S: timing["weights"][-1]}

    def stop(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# The rollout side: a server over the link


class RolloutServer:
    """The rollout process of a split run: receives the steps, then for each step the weights,
    generates its batch (RolloutWorker.generate, in this thread) and sends it; mirrors every
    exchange of the train process's Run loop (LinkSource), stop agreement included."""

    def __init__(self, link: HostLink, parts, log: Callable[[str], None] = logs.info):
        _check_one_device_each(parts.config, parts)
        self.parts, self.log = parts, log
        self.lag = stream_lag(parts.config, parts.trainer)
        self.wire = _Wire(link, "rollout", parts.trainer)
        self.generated: list[tuple[int, int]] = []    # (step, version of the weights used)
        self.start_step = self.last_step = 0

    def _generate(self, rl_step: int, params, version: int) -> RolloutBatch:
        self.generated.append((rl_step, version))
        start = time.perf_counter()
        batch = self.parts.worker.generate(rl_step, params, version)
        batch.metrics[names.TIME_GENERATE_S] = time.perf_counter() - start
        return batch

    def serve(self) -> None:
        """Serves the steps the train process's run() asks for, then returns (a stop agreed
        with the train process raises StopRequested here too)."""
        info = self.wire.start_info(None)
        self.parts.stream.load_state_dict(info["data_state"])
        first, last = self.start_step, self.last_step = info["start_step"], info["last_step"]
        if last <= first:
            return
        if first:
            self.log(f"[rollout] resuming at step {first}")
        stop_request.agree_with(self.wire.either_signal)
        try:
            pending = None
            for i in range(first, last):
                stop_request.check_stop_at_step()       # Run's check at each step boundary
                if self.lag == 0 or i == first:
                    pending = self._generate(i, *self.wire.weights())
                self.wire.batch(pending)
                if self.lag == 1 and i + 1 < last:
                    pending = self._generate(i + 1, *self.wire.weights())
            stop_request.check_stop_at_step()           # Run's check before its final save
        finally:
            stop_request.agree_with(None)
