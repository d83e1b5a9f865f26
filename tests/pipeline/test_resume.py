"""jrl.pipeline.loop.resume: resuming from an older checkpoint than the newest (--resume-step)."""

import os

import jax
import numpy as np

from jrl.pipeline.loop.runner import Run
from tests.pipeline.tiny import tiny_config


def test_resume_from_an_older_step_sets_the_newer_ones_aside_and_ends_bitwise_equal(tmp_path):
    config = tiny_config("train.steps=4", "checkpoint.every=1")
    workdir = str(tmp_path / "run")
    straight = Run(config, workdir, log=lambda *_: None).run()      # checkpoints 2, 3, 4 kept
    logs = []
    again = Run(config, workdir, resume_step=2, log=logs.append)
    resumed = again.run()
    assert again.resumed_from == 2
    assert any("[3, 4] are set aside" in line for line in logs), logs
    names = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    # Steps 3 and 4 written again; the superseded ones kept beside them.
    assert {"3", "4", "3.superseded-0", "4.superseded-0"} <= set(names), names
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(straight.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
