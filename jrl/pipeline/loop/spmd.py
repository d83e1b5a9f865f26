"""Several processes (SPMD): every host's share of a step's rollout, joined on every host
(GatheredSource, the rollout source of Run's loop in this mode)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from jrl.metrics import names
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.loop.sources import InProcessSource


def allgather_objects(obj) -> list:
    """Every process's `obj` (picklable), in process order, on every process."""
    from jax.experimental import multihost_utils
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(
        np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(gathered[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def gather_rollout(local: RolloutBatch) -> RolloutBatch:
    """Every host's RolloutBatch (its share of the step's prompts) joined in process order into
    the step's global batch, identical on every host; metrics combined by their reductions
    (weighted by each host's sample count)."""
    parts = allgather_objects(
        (local.rl_step, local.samples, local.examples, local.rewards, local.metrics))
    if len({p[0] for p in parts}) != 1:
        raise RuntimeError(f"processes disagree on the RL step: {[p[0] for p in parts]}")
    samples = [s for p in parts for s in p[1]]
    examples = [e for p in parts for e in p[2]]
    rewards = np.concatenate([np.asarray(p[3], np.float32) for p in parts])
    metrics = names.combine_parts([p[4] for p in parts],
                                  weights=[max(len(p[1]), 1) for p in parts])
    return dataclasses.replace(local, samples=samples, examples=examples, rewards=rewards,
                               metrics=metrics)


def any_process_signal(signum: int) -> int:
    """The largest stop signal of any process of the job (0: none was asked to stop): one
    all-gather of a scalar, at each step boundary (jrl.stop_request.agree_with)."""
    from jax.experimental import multihost_utils
    return int(np.max(multihost_utils.process_allgather(np.asarray(signum, np.int32))))


class GatheredSource(InProcessSource):
    """This process's sampler threads sample its share of each step's prompts; the shares are
    joined into the step's global batch (gather_rollout), the same on every process, and every
    process agrees on a stop at each step boundary (any_process_signal)."""

    agree = staticmethod(any_process_signal)

    def next_batch(self) -> RolloutBatch:
        return gather_rollout(super().next_batch())
