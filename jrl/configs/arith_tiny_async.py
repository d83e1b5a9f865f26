"""The embedded demo in asynchronous mode: staleness bound 1, interruptible generation, TIS on
p_old / p_b with p_old recomputed by the trainer (the decoupled form).

On a CPU, run it with 8 host devices split 4 rollout + 4 train:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m jrl.cli.train --config jrl/configs/arith_tiny_async.py
"""

import dataclasses

from jrl.configs import arith_tiny
from jrl.pipeline.config import RunConfig


def get_config() -> RunConfig:
    base = arith_tiny.get_config()
    return dataclasses.replace(
        base,
        name="arith_tiny_async",
        algorithm=dataclasses.replace(base.algorithm, tis_cap=2.0),
        # Each of the 4 train devices computes whole micro-batches (bitwise equal to one device).
        # train.old_logp follows TIS: "recompute" (TIS then corrects p_old / p_b, the staleness
        # drift).
        train=dataclasses.replace(base.train, micro_batches=4),
        pipeline=dataclasses.replace(base.pipeline, max_staleness=1, rollout_devices=4,
                                     train_devices=4, interrupt=True),
    )
