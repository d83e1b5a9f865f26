"""AdmissionQueue (jrl.pipeline.rollout.admission) on hand-built samples: which step a version may start
(b * U - k), the caller's version against the pending requests, prompt ids (sharded too), step
order of the batches, scoring, overlong shaping, dynamic sampling's rounds and the rollout/*
metrics, each by hand. No model, no threads: the queue is driven as a sampler would drive it."""

import numpy as np
import pytest

from jrl.losses import RewardShaping
from jrl.pipeline.rollout.admission import AdmissionQueue
from jrl.sampling import FINISH_LENGTH, FINISH_STOP
from tests.pipeline.parts.fakes import FakeTask, options, sample, stream


def _queue(opts, *, first_step=0, last_step=3, task=None, prompts=None):
    emitted = []
    queue = AdmissionQueue(first_step=first_step, last_step=last_step,
                           stream=prompts or stream(), task=task or FakeTask(), options=opts,
                           emit=emitted.append)
    return queue, emitted


def _drain(queue, version):
    """Every request a sampler holding weights of `version` may take now."""
    out = []
    while (request := queue.pop(version)) is not None:
        out.append(request)
    return out


def _prompt_ids(requests):
    return sorted({request[0] for request in requests})


def _finish(queue, prompt_id, group_size=2, lengths=None, max_new_tokens=8):
    """Every sample of a prompt's group (3 tokens unless `lengths`; a response of
    max_new_tokens ends by length, as a sampler's would)."""
    for index in range(group_size):
        length = 3 if lengths is None else lengths[index]
        queue.on_sample(sample(prompt_id, index, length,
                               finish=FINISH_LENGTH if length == max_new_tokens else FINISH_STOP))


def _table_task(rewards):
    """Task rewards from {prompt_id: [reward of each sample index]}."""
    return FakeTask(reward=lambda s, example: rewards[s.prompt_id][s.sample_index])


# With 2 prompts per step, step b holds prompts 2b and 2b + 1.
@pytest.mark.parametrize("updates,staleness,expected", [
    # Synchronous: step b needs version b.
    (1, 0, [(0, [0, 1]), (0, []), (1, [2, 3]), (2, [4, 5]), (5, [])]),
    # U = 2, k = 1: step b needs 2b - 1: step 0 -1, step 1 1, step 2 3.
    (2, 1, [(0, [0, 1]), (1, [2, 3]), (2, []), (3, [4, 5])]),
    # k = 2: steps 0, 1 and 2 (b - 2 <= 0) all start with version 0; nothing past last_step.
    (1, 2, [(0, [0, 1, 2, 3, 4, 5]), (9, [])]),
], ids=["U1_k0", "U2_k1", "U1_k2"])
def test_a_step_starts_once_the_version_reaches_b_times_U_minus_k(updates, staleness,
                                                                  expected):
    opts = options(updates_per_step=updates, max_staleness=staleness)
    assert [opts.first_version(b) for b in range(3)] == [b * updates - staleness
                                                         for b in range(3)]
    queue, _ = _queue(opts)
    for version, prompt_ids in expected:
        requests = _drain(queue, version)
        assert _prompt_ids(requests) == prompt_ids, version
        assert len(requests) == 2 * len(prompt_ids)            # G = 2 samples each


def test_pending_requests_are_checked_against_the_callers_version():
    """A sampler still holding version 0 cannot take step 1's requests that a sampler with
    version 1 admitted (k = 0: step 1 needs version 1)."""
    queue, _ = _queue(options())
    assert _prompt_ids(_drain(queue, 0)) == [0, 1]
    assert queue.pop(1)[:2] == (2, 0)           # admits step 1 (prompts 2, 3), takes one
    assert queue.pop(0) is None                 # three step-1 requests pending, none for v0
    assert [r[:2] for r in _drain(queue, 1)] == [(2, 1), (3, 0), (3, 1)]


def test_requests_carry_consecutive_prompt_ids_every_sample_index_and_the_rendered_prompt():
    queue, _ = _queue(options(max_new_tokens=6))
    requests = _drain(queue, 0)
    assert [(p, i, max_new) for p, i, _, max_new in requests] == [
        (0, 0, 6), (0, 1, 6), (1, 0, 6), (1, 1, 6)]
    # FakeTask renders example e as [1, 3 + e.id]; prompt p is example p (unshuffled stream).
    assert [tokens.tolist() for _, _, tokens, _ in requests] == [[1, 3], [1, 3], [1, 4],
                                                                 [1, 4]]
    assert requests[0][2].dtype == np.int32
    assert queue.example_of(1).id == 1          # in flight: a multi-turn driver resets on it


def test_a_sharded_stream_names_its_prompts_by_their_global_position():
    """Shard 1 of 2, 2 prompts each: the global draw of 4 is [0, 1, 2, 3] and shard 1 gets 2, 3
    (ids = position 0 + 1 * 2 + j); step 1 draws [4..7]: ids 6, 7."""
    queue, _ = _queue(options(group_size=1, shard_index=1), prompts=stream().shard(1, 2))
    step0 = _drain(queue, 0)
    assert [r[0] for r in step0] == [2, 3]
    assert [r[2].tolist() for r in step0] == [[1, 5], [1, 6]]   # examples 2 and 3
    assert [r[0] for r in _drain(queue, 1)] == [6, 7]


def test_batches_leave_in_step_order_with_samples_in_admission_order():
    """k = 1: steps 0 and 1 start together. Step 1 finishing first emits nothing; step 0's
    samples finishing in reverse order still give the batch in admission order."""
    queue, emitted = _queue(options(prompts=1, max_staleness=1), last_step=2)
    assert _prompt_ids(_drain(queue, 0)) == [0, 1]
    _finish(queue, 1)
    assert emitted == [] and not queue.done()
    queue.on_sample(sample(0, 1))
    queue.on_sample(sample(0, 0))
    assert [b.rl_step for b in emitted] == [0, 1] and queue.done()
    assert [(s.prompt_id, s.sample_index) for s in emitted[0].samples] == [(0, 0), (0, 1)]
    assert [e.id for e in emitted[1].examples] == [1, 1]


def test_rewards_overlong_shaping_and_rollout_metrics_by_hand():
    """3 prompts x 2 samples, max_new_tokens 8, an overlong ramp of 2 tokens (factor 1): no
    penalty up to 8 - 2 = 6 tokens, -(L - 6) / 2 above, -1 at 8."""
    rewards = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 0.0]}
    lengths = {0: [4, 8], 1: [7, 6], 2: [3, 3]}
    queue, emitted = _queue(options(prompts=3, shaping=RewardShaping(overlong_buffer=2)),
                            last_step=1, task=_table_task(rewards))
    _drain(queue, 0)
    for prompt_id in (2, 0, 1):
        _finish(queue, prompt_id, lengths=lengths[prompt_id])
    (batch,) = emitted
    assert [s.num_model_tokens for s in batch.samples] == [4, 8, 7, 6, 3, 3]
    # Shaped: [1 - 0, 0 - 1, 1 - (7 - 6) / 2, 1 - 0, 0, 0].
    np.testing.assert_array_equal(batch.rewards, np.array([1, -1, 0.5, 1, 0, 0], np.float32))
    assert batch.rewards.dtype == np.float32 and batch.group_size == 2
    m = batch.metrics
    assert m["rollout/reward_mean"] == 0.5                # task rewards: (1 + 0 + 1 + 1) / 6
    assert m["rollout/response_len_mean"] == pytest.approx(31 / 6)   # (4+8+7+6+3+3) / 6
    assert m["rollout/truncated_frac"] == pytest.approx(1 / 6)
    assert m["rollout/zero_std_groups_all_correct"] == 1             # prompt 1: 1, 1
    assert m["rollout/zero_std_groups_all_wrong"] == 1               # prompt 2: 0, 0
    assert (m["rollout/reward_errors"], m["rollout/sampling_rounds"],
            m["rollout/groups_kept"]) == (0, 1, 3)
    assert m["time/rollout_s"] >= 0.0
    assert batch.data_state["index"] == 3                 # the stream after the 3 prompts
    assert batch.first_reward_error is None


def test_reward_errors_are_summed_and_the_first_in_admission_order_is_named():
    task = FakeTask(errors={2: (1, "prompt 2: late"), 1: (2, "prompt 1: first")})
    queue, emitted = _queue(options(prompts=3), last_step=1, task=task)
    _drain(queue, 0)
    for prompt_id in (2, 1, 0):                           # prompt 2 is scored first
        _finish(queue, prompt_id)
    assert task.scored == [2, 1, 0]
    assert emitted[0].metrics["rollout/reward_errors"] == 3
    assert emitted[0].first_reward_error == "prompt 1: first"


def test_dynamic_sampling_replaces_groups_without_spread_up_to_max_rounds():
    """2 prompts, 2 rounds. Round 1: prompt 0 (1, 0) has a spread, prompt 1 (1, 1) none, so the
    step needs 2 - 1 = 1 more: prompt 2 (0, 1). The batch: prompts 0 and 2; the metrics count
    every group seen."""
    rewards = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 1.0]}
    queue, emitted = _queue(options(shaping=RewardShaping(dynamic_sampling=True), max_rounds=2),
                            last_step=1, task=_table_task(rewards))
    assert _prompt_ids(_drain(queue, 0)) == [0, 1]
    _finish(queue, 0)
    _finish(queue, 1)
    assert emitted == [] and not queue.done()             # waits for its replacement round
    assert [r[:2] for r in _drain(queue, 0)] == [(2, 0), (2, 1)]
    _finish(queue, 2)
    (batch,) = emitted
    assert [s.prompt_id for s in batch.samples] == [0, 0, 2, 2]
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 1])
    assert batch.metrics["rollout/reward_mean"] == pytest.approx(4 / 6)   # (1+0+1+1+0+1) / 6
    assert (batch.metrics["rollout/sampling_rounds"], batch.metrics["rollout/groups_kept"],
            batch.metrics["rollout/zero_std_groups_all_correct"]) == (2, 2, 1)
    assert batch.data_state["index"] == 3


def test_after_max_rounds_a_step_keeps_the_groups_it_has():
    """As above but prompt 2 is (0, 0) too: after round 2 of 2 the batch holds prompt 0 alone."""
    rewards = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 0.0]}
    queue, emitted = _queue(options(shaping=RewardShaping(dynamic_sampling=True), max_rounds=2),
                            last_step=1, task=_table_task(rewards))
    _drain(queue, 0)
    _finish(queue, 0)
    _finish(queue, 1)
    _drain(queue, 0)
    _finish(queue, 2)
    (batch,) = emitted
    assert [s.prompt_id for s in batch.samples] == [0, 0] and batch.rewards.tolist() == [1, 0]
    assert (batch.metrics["rollout/sampling_rounds"], batch.metrics["rollout/groups_kept"],
            batch.metrics["rollout/zero_std_groups_all_correct"],
            batch.metrics["rollout/zero_std_groups_all_wrong"]) == (2, 1, 1, 1)
    assert queue.pop(5) is None and queue.done()


def test_a_replacement_round_is_admitted_before_the_next_step():
    """k = 1, 1 prompt per step: steps 0 (prompt 0) and 1 (prompt 1) start with version 0. Prompt
    0 has no spread, so step 0 needs a round; at version 1 step 2 may start too, but the
    replacement comes first: prompt 2 belongs to step 0 and step 2 gets prompt 3."""
    rewards = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 1.0], 3: [0.0, 1.0]}
    queue, emitted = _queue(options(prompts=1, max_staleness=1, max_rounds=2,
                                    shaping=RewardShaping(dynamic_sampling=True)),
                            task=_table_task(rewards))
    assert _prompt_ids(_drain(queue, 0)) == [0, 1]
    _finish(queue, 0)
    assert [r[:2] for r in _drain(queue, 1)] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    _finish(queue, 1)
    assert emitted == []                                  # step 0 is still short of a group
    _finish(queue, 2)
    assert [(b.rl_step, [s.prompt_id for s in b.samples]) for b in emitted] == [
        (0, [2, 2]), (1, [1, 1])]
    assert emitted[0].metrics["rollout/sampling_rounds"] == 2
