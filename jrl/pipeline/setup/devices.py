"""Where a run's work goes: the rollout and train devices of one process, and what a run over
several processes (SPMD) needs of its config."""

from __future__ import annotations

from typing import Sequence

from jrl.parallel import split_devices
from jrl.pipeline.config import RunConfig


def rollout_and_train_devices(devices: Sequence, rollout: int, train: int) -> tuple[list, list]:
    """(rollout devices, train devices) from pipeline.rollout_devices / pipeline.train_devices.

    0 and 0: both sides share the first device. Otherwise jrl.parallel.split_devices: the first
    `rollout` devices sample and the next `train` devices train (disjoint).
    """
    devices = list(devices)
    if rollout == 0 and train == 0:
        return devices[:1], devices[:1]
    if rollout <= 0 or train <= 0:
        raise ValueError(f"pipeline.rollout_devices={rollout} and pipeline.train_devices={train}:"
                         " set both (a disjoint split) or neither (share the first device)")
    if rollout + train > len(devices):
        raise ValueError(f"pipeline.rollout_devices + pipeline.train_devices = {rollout + train} "
                         f"but only {len(devices)} devices are available")
    return split_devices(devices, rollout, train)


def check_spmd(cfg: RunConfig, *, process_count: int, device_count: int) -> None:
    """The requirements of one SPMD run over several processes (ValueError naming the key)."""
    if cfg.rollout.prompts_per_step % process_count:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be "
                         f"divisible by the number of processes ({process_count})")
    if cfg.recipe().shaping.dynamic_sampling:
        raise ValueError(f"algorithm.dynamic_sampling (on in algorithm.recipe={cfg.algorithm.recipe!r}'s "
                         "recipe unless set to false) is not supported with several "
                         "processes (every host must draw the same number of prompts)")
    shards = device_count // max(1, cfg.pipeline.train_mesh_tensor)
    if cfg.train.micro_batches % shards:
        raise ValueError(f"train.micro_batches={cfg.train.micro_batches} must be a multiple "
                         f"of the row shards of the train mesh ({shards} = {device_count} "
                         f"devices / tensor {cfg.pipeline.train_mesh_tensor})")
