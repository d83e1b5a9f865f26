"""RolloutWorker (jrl.pipeline.rollout.worker) on FakeSamplers and a FakeTask: batches carry the
version that sampled them, groups are formed and scored, the threads run ahead exactly as far
as max_staleness allows, a published version reaches later batches (mid-sample with interrupt,
after the sample without), each sampler gets its own device's copy, and errors and stops end
the threads. Every concurrency test checks that the concurrency happened (what the samplers
took, with which version, while the "trainer" had not published)."""

import threading

import pytest

from jrl.pipeline.rollout.worker import RolloutWorker
from tests.pipeline.parts.fakes import FakeSampler, FakeTask, options, stream, wait_for

# A worker that never delivers would otherwise hang the test until the suite's timeout.
pytestmark = pytest.mark.timeout(60)


def _worker(samplers, opts, devices=None, task=None, prompts=None):
    devices = devices or [f"d{r}" for r in range(len(samplers))]
    return RolloutWorker(samplers, devices, prompts or stream(), task or FakeTask(), opts)


def _versions(batch):
    return [s.versions.tolist() for s in batch.samples]


def _idles_after(sampler, polls: int = 20):
    """Waits until the sampler has asked for work `polls` more times and got none."""
    start = sampler.empty_polls
    wait_for(lambda: sampler.empty_polls >= start + polls, "the sampler to sit idle")


def test_generate_makes_one_steps_batch_in_this_thread_with_the_given_weights():
    sampler = FakeSampler()
    worker = _worker([sampler], options())
    batch = worker.generate(1, "weights-v1", 1)           # k = 0: step 1 needs version 1
    assert batch.rl_step == 1 and batch.group_size == 2
    # A fresh stream: prompts 0 and 1, each a group of sample indices 0, 1.
    assert [(s.prompt_id, s.sample_index) for s in batch.samples] == [(0, 0), (0, 1), (1, 0),
                                                                       (1, 1)]
    assert _versions(batch) == [[1, 1, 1]] * 4
    assert {params for _, params in sampler.params_seen} == {"weights-v1"}
    assert batch.rewards.tolist() == [0, 1, 0, 1]         # FakeTask: sample index parity
    assert sampler.swaps == [] and sampler.threads == {threading.get_ident()}
    with pytest.raises(RuntimeError, match=r"step 2 needs weights of version >= 2 "
                                           r"\(max_staleness=0\), got 1"):
        worker.generate(2, "weights-v1", 1)
    # k = 1: step 2 may start with version 2 - 1 = 1.
    assert _worker([FakeSampler()], options(max_staleness=1)).generate(2, "w", 1).rl_step == 2


def test_the_worker_refuses_a_sampler_per_device_mismatch_and_a_start_without_weights():
    with pytest.raises(ValueError, match="2 samplers for 1 devices"):
        RolloutWorker([FakeSampler(), FakeSampler()], ["d0"], stream(), FakeTask(), options())
    worker = _worker([FakeSampler()], options())
    assert worker.published_version == -1
    with pytest.raises(RuntimeError, match="no weights were published yet"):
        worker.start(0, 1)


def test_synchronous_threads_wait_for_each_published_version():
    """k = 0: after step 0's batch the sampler asks for work and gets none until version 1 is
    published; every token of batch i has version i."""
    sampler = FakeSampler()
    worker = _worker([sampler], options())
    worker.publish(["w0"], 0)
    worker.start(0, 3)
    try:
        batch = worker.next_batch()
        assert batch.rl_step == 0 and _versions(batch) == [[0, 0, 0]] * 4
        _idles_after(sampler)
        assert {prompt for prompt, _, _ in sampler.taken} == {0, 1}   # nothing of step 1
        for version in (1, 2):
            worker.publish([f"w{version}"], version)
            batch = worker.next_batch()
            assert batch.rl_step == version and _versions(batch) == [[version] * 3] * 4
        assert sampler.swaps == [1, 2]
        # Step b's requests (prompts 2b, 2b + 1) were taken with version b, never earlier.
        assert sorted({(prompt // 2, version) for prompt, _, version in sampler.taken}) == [
            (0, 0), (1, 1), (2, 2)]
    finally:
        worker.stop()
    assert sampler.ended


def test_with_staleness_one_the_threads_produce_a_step_ahead_of_the_trainer():
    """k = 1: steps 0 and 1 both come from version 0 with nothing published in between (the
    worker ran ahead while the trainer would train on step 0); step 2 needs version 1 and
    waits for it."""
    sampler = FakeSampler()
    worker = _worker([sampler], options(prompts=1, max_staleness=1))
    worker.publish(["w0"], 0)
    worker.start(0, 3)
    try:
        first, second = worker.next_batch(), worker.next_batch()
        assert [first.rl_step, second.rl_step] == [0, 1]
        assert _versions(first) == _versions(second) == [[0, 0, 0]] * 2
        _idles_after(sampler)
        assert {prompt for prompt, _, _ in sampler.taken} == {0, 1}   # step 2 held back
        worker.publish(["w1"], 1)
        third = worker.next_batch()
        assert third.rl_step == 2 and _versions(third) == [[1, 1, 1]] * 2
    finally:
        worker.stop()


@pytest.mark.parametrize("interrupt", [True, False], ids=["interrupt", "wait"])
def test_a_version_published_mid_sample(interrupt):
    """One slot, one sample per step, k = 1. Step 1's sample (prompt 1) is held after its first
    token until version 1 is published. With interrupt the new weights are swapped in at the
    next call: tokens [0, 1, 1]; without, the sample finishes with version 0 and the swap waits
    for it. Either way step 2 (needs version 1) starts with version 1."""
    reached, resume = threading.Event(), threading.Event()

    def hold_step_1(live):
        if live == [(1, 0, 1)] and not resume.is_set():
            reached.set()
            assert resume.wait(20), "the test never published version 1"

    sampler = FakeSampler(num_slots=1, between_calls=hold_step_1)
    worker = _worker([sampler], options(prompts=1, group_size=1, max_staleness=1,
                                        interrupt=interrupt))
    worker.publish(["w0"], 0)
    worker.start(0, 3)
    try:
        assert _versions(worker.next_batch()) == [[0, 0, 0]]
        assert reached.wait(20)
        worker.publish(["w1"], 1)
        resume.set()
        step1, step2 = worker.next_batch(), worker.next_batch()
        assert _versions(step1) == ([[0, 1, 1]] if interrupt else [[0, 0, 0]])
        assert [params for prompt, params in sampler.params_seen if prompt == 1] == (
            ["w0", "w1", "w1"] if interrupt else ["w0", "w0", "w0"])
        assert _versions(step2) == [[1, 1, 1]]
        assert sampler.swaps == [1]
    finally:
        worker.stop()


def test_each_sampler_gets_its_own_devices_copy_of_the_weights():
    """Two samplers of one slot each, held until both hold a request (so both work): sampler r
    precompiles and decodes with copy r of what was published."""
    both = threading.Barrier(2, timeout=20)
    held = set()

    def sampler(r):
        def wait_for_the_other(live):
            if live and r not in held:
                held.add(r)
                both.wait()
        return FakeSampler(num_slots=1, between_calls=wait_for_the_other)

    samplers = [sampler(0), sampler(1)]
    worker = _worker(samplers, options(group_size=1, precompile=True))
    worker.publish(["w0@d0", "w0@d1"], 0)
    worker.start(0, 2)
    try:
        worker.next_batch()
        worker.publish(["w1@d0", "w1@d1"], 1)
        worker.next_batch()
    finally:
        worker.stop()
    for r, s in enumerate(samplers):
        assert s.precompiled == [f"w0@d{r}"]
        seen = {params for _, params in s.params_seen}
        assert seen and seen <= {f"w0@d{r}", f"w1@d{r}"}, (r, seen)
    assert {prompt for s in samplers for prompt, _, _ in s.taken} == {0, 1, 2, 3}


def test_a_sampler_error_surfaces_in_next_batch_and_stops_the_other_samplers():
    class DeviceLost(RuntimeError):
        pass

    healthy, broken = FakeSampler(), FakeSampler(crash=DeviceLost("device lost in decode"))
    worker = _worker([healthy, broken], options())
    worker.publish(["w0", "w0"], 0)
    worker.start(0, 50)
    with pytest.raises(DeviceLost, match="device lost in decode"):
        for _ in range(2):      # the healthy sampler may finish step 0's batch first
            worker.next_batch()
    worker.stop()
    assert healthy.ended and broken.ended


def test_stop_ends_a_worker_waiting_for_weights():
    sampler = FakeSampler()
    worker = _worker([sampler], options())
    worker.publish(["w0"], 0)
    worker.start(0, 3)
    worker.next_batch()
    _idles_after(sampler)                       # waiting for version 1
    worker.stop()
    assert sampler.ended
    with pytest.raises(RuntimeError, match="rollout thread ended without producing a batch"):
        worker.next_batch()


def test_a_restarted_worker_gives_the_first_steps_batch_not_a_leftover():
    """k = 1: after step 0's batch is taken, step 1's is produced ahead. A Run interrupted
    inside step 0 stops the worker, restores the stream and, on run() again, starts it at step
    0 (jrl.pipeline.loop.runner); the first batch must then be step 0's, not the leftover of step 1
    (the Run raises 'the rollout worker gave step 1's batch for step 0')."""
    sampler = FakeSampler()
    prompts = stream()
    start_state = prompts.state_dict()
    worker = _worker([sampler], options(prompts=1, max_staleness=1), prompts=prompts)
    worker.publish(["w0"], 0)
    worker.start(0, 3)
    assert worker.next_batch().rl_step == 0
    wait_for(lambda: (1, 1) in sampler.finished, "step 1's batch to be produced ahead")
    worker.stop()
    prompts.load_state_dict(start_state)
    worker.start(0, 3)
    try:
        assert worker.next_batch().rl_step == 0
    finally:
        worker.stop()
