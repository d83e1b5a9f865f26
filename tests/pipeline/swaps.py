"""A run whose weight swap lands inside a sample (for tests that must see one happen)."""

import functools
import time

from jrl.pipeline.setup.samplers import build_sampler
from jrl.pipeline.loop.runner import Run
from jrl.sampling import Sampler
from tests.pipeline.tiny import tiny_config

# 2 rollout + 4 train host devices, max_staleness 1, KV recompute on swap, one decode step per
# call (so that the swap can land between any two tokens), room for 24 tokens.
SWAP_RUN = ("eval.greedy=false", "checkpoint.every=0", "pipeline.max_staleness=1",
            "pipeline.kv_on_swap=recompute", "rollout.steps_per_call=1",
            "sampling.max_new_tokens=24", "pipeline.rollout_devices=2",
            "pipeline.train_devices=4", "train.micro_batches=4")


class WaitsForNewWeights(Sampler):
    """A Sampler that, once, while every request it holds is of step 1 (tiny_config draws 4
    prompts per step: step = prompt_id // 4) and at least two of them, so at least one is
    already decoding with version 0, waits for version 1 before its next decode call. The swap
    then lands inside a sample whatever the relative speed of rollout and training (with
    max_staleness 1, step 1 starts with version 0, and version 1 needs only step 0's batch,
    which this sampler no longer holds: no deadlock)."""

    def serve(self, params, *, next_request, on_sample, poll_weights=None, version=0, **kw):
        live, state = {}, {"version": version, "waited": False}

        def take():
            request = next_request()
            if request is not None:
                live[request[:2]] = request[0] // 4
            return request

        def finished(sample):
            live.pop((sample.prompt_id, sample.sample_index), None)
            on_sample(sample)

        def poll():
            update = poll_weights()
            if update is None and not state["waited"] and state["version"] == 0 and \
                    len(live) >= 2 and min(live.values()) == 1:
                state["waited"] = True
                deadline = time.perf_counter() + 120
                while update is None and time.perf_counter() < deadline:
                    time.sleep(0.005)
                    update = poll_weights()
            if update is not None:
                state["version"] = update[1]
            return update
        return super().serve(params, next_request=take, on_sample=finished, poll_weights=poll,
                             version=version, **kw)


def run_with_a_swap_inside_a_sample(workdir: str, *overrides: str):
    """Runs tiny_config(SWAP_RUN, overrides) with WaitsForNewWeights samplers; returns (run,
    the RolloutBatch of every step) after checking that the swap landed inside a step-1 sample
    (its tokens carry versions 0 and 1), that the samplers recomputed their live caches, and
    that every token was still reproduced exactly (numerical mismatch 0, all tokens held)."""
    run = Run(tiny_config(*SWAP_RUN, *overrides), workdir, log=lambda *_: None,
              sampler_factory=functools.partial(build_sampler, cls=WaitsForNewWeights))
    rollouts = []
    prepare = run.trainer.prepare
    run.trainer.prepare = lambda rollout: rollouts.append(rollout) or prepare(rollout)
    run.run()
    assert any(set(s.versions.tolist()) == {0, 1} for s in rollouts[1].samples)
    assert sum(sampler.last_stats.get("refreshes", 0) for sampler in run.worker.samplers) >= 1
    for record in run.history:
        assert record["mismatch/kv_mixed_token_frac"] == 0.0
        assert record["mismatch/numerical_abs"] == 0.0
        assert record["mismatch/held_token_frac"] == 1.0
    return run, rollouts
