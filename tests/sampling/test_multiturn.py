"""Multi-turn episodes in the sampler: a model turn ends at a stop token, the host appends an
observation into the slot's KV cache (Sampler.serve's on_turn), and decoding resumes.

The invariant carries over: every model token's p_b equals the train forward's p_o over the
whole episode (prompt, model turns, observations) bit for bit, in train batches laid out unlike
the sampler's slots, while other slots keep decoding and refilling during tool waits. Setting:
the tiny model of helpers.py with 8 of its 32 tokens as stop tokens, so that turns are short and
an episode of 24 response tokens holds several of them.
"""

import concurrent.futures
import functools
import threading
import time

import numpy as np
import pytest

from jrl.sampling import Sampler

from .helpers import (CONFIG, MAX_PROMPT_LEN, PREFILL_BUCKETS, PROMPTS, bits_equal, contract,
                      model_params, sampling, train_logprobs)

MAX_NEW = 24
MAX_OBS = 3
STOPS = (1, 2, 3, 4, 5, 6, 7, 8)
TURNS = 3     # model turns per episode: two observations, then the episode ends


def multiturn_sampler(*, num_slots=4, recompute_kv_on_swap=False) -> Sampler:
    return Sampler(CONFIG, contract(), sampling(max_new_tokens=MAX_NEW, stop_tokens=STOPS),
                   num_slots=num_slots, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4,
                   return_entropy=True, recompute_kv_on_swap=recompute_kv_on_swap,
                   max_observation_len=MAX_OBS, prefill_buckets=PREFILL_BUCKETS)


def observation_for(sample, turn: int) -> np.ndarray:
    """A deterministic observation of 1..3 tokens in 20..31 (no stop token), a function of the
    episode and turn only."""
    size = 1 + (sample.prompt_id + sample.sample_index + turn) % MAX_OBS
    return np.asarray([20 + (sample.sample_index * 5 + turn * 3 + i) % 12 for i in range(size)],
                      np.int32)


def model_turns(sample) -> int:
    """Runs of model tokens in the response (a turn = model tokens up to an observation)."""
    mask = sample.model_token_mask().astype(int)
    return int(mask[0] + np.sum(np.diff(mask) == 1))


class Tools:
    """on_turn for the tests: a thread pool answering each turn after a delay. `delays` picks
    a delay (seconds) per (prompt_id, sample_index, turn)."""

    def __init__(self, delays=lambda key: 0.0, turns=TURNS):
        self.pool = concurrent.futures.ThreadPoolExecutor(4)
        self.delays, self.turns = delays, turns
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, partial):
        turn = model_turns(partial)
        with self.lock:
            self.calls.append((partial.prompt_id, partial.sample_index, turn))

        def answer():
            time.sleep(self.delays((partial.prompt_id, partial.sample_index, turn)))
            return observation_for(partial, turn) if turn < self.turns else None
        return self.pool.submit(answer)


@functools.lru_cache(maxsize=None)
def episodes(num_slots=4, delay_seed=None):
    tools = Tools() if delay_seed is None else Tools(
        lambda key: np.random.default_rng([delay_seed, *key]).uniform(0, 0.03))
    s = multiturn_sampler(num_slots=num_slots)
    samples = s.generate(model_params(0), PROMPTS, on_turn=tools)
    return samples, dict(s.last_stats), tools.calls


def test_episodes_alternate_model_turns_and_observations():
    samples, stats, calls = episodes()
    assert len(samples) == 12
    multi = [s for s in samples if model_turns(s) > 1]
    assert any(model_turns(s) == TURNS for s in samples), "some episode must reach 3 turns"
    assert stats["appends"] == sum(model_turns(s) - 1 for s in samples) >= 4
    assert stats["turns_paused"] == len(calls)
    for s in multi:
        mask = s.model_token_mask()
        starts = np.flatnonzero(np.diff(mask.astype(int)) == -1) + 1   # first obs token of each
        for turn, start in enumerate(starts, 1):
            obs = observation_for(s, turn)
            # Observation tokens come right after the stop token that ended the model's turn.
            assert s.tokens[start - 1] in STOPS and mask[start - 1]
            np.testing.assert_array_equal(s.tokens[start:start + obs.size], obs)
            assert not mask[start:start + obs.size].any()
        obs_rows = ~mask
        assert np.all(s.versions[obs_rows] == -1) and np.all(s.versions[mask] == 0)
        assert np.all(s.behavior_logp[obs_rows] == 0.0)
        assert np.all(s.logit_floor[obs_rows] == -np.inf)
        assert np.all(np.isfinite(s.behavior_logp[mask])) and np.all(s.behavior_logp[mask] <= 0)
    # An episode ends on the stop token of its last turn ("stop"), or at its token limit
    # ("length": mid-turn, or at a turn end whose observation no longer fits).
    for s in samples:
        ends_turn = s.tokens[-1] in STOPS and s.model_token_mask()[-1]
        assert ends_turn or s.finish_reason == "length"
        if s.finish_reason == "stop":
            assert model_turns(s) == TURNS


def test_model_tokens_p_b_equals_train_forward_over_whole_episodes_bitwise():
    samples, _, _ = episodes()
    params, c = model_params(0), contract()
    count = len(samples)
    length = MAX_PROMPT_LEN + MAX_NEW
    # Layout 1: reverse order, one batch, padded to 40; layout 2: shuffled, micro-batches of 5.
    first = train_logprobs(params, samples, c, 1.0, order=range(count)[::-1], batch=count,
                           length=40)
    shuffled = np.random.default_rng(1).permutation(count)
    second = [None] * count
    for start in range(0, count, 5):
        part = shuffled[start:start + 5]
        got = train_logprobs(params, samples, c, 1.0, order=part, batch=5, length=length)
        for i in part:
            second[i] = got[i]
    for i, s in enumerate(samples):
        mask = s.model_token_mask()
        assert bits_equal(s.behavior_logp[mask], first[i][mask]), i
        assert bits_equal(s.behavior_logp[mask], second[i][mask]), i


def test_episodes_do_not_depend_on_tool_timing_or_slot_count():
    """Tool delays reorder pauses, appends and refills; 2 slots instead of 4 change every
    batch; the per-sample PRNG streams and batch-invariant kernels give the same episodes."""
    base, _, _ = episodes()
    for other, _, _ in (episodes(delay_seed=3), episodes(num_slots=2, delay_seed=4)):
        for a, b in zip(base, other):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            assert bits_equal(a.behavior_logp, b.behavior_logp)
            np.testing.assert_array_equal(a.model_token_mask(), b.model_token_mask())


def test_other_slots_keep_decoding_while_one_waits_for_its_tool():
    """One episode's tool answers only once the 11 other episodes have finished (or after 30 s,
    which fails the test): the sampler must keep decoding and refilling the other slots while
    that slot waits."""
    slow = (10, 0, 1)
    order = []
    others_done = threading.Event()

    def on_sample(sample):
        order.append((sample.prompt_id, sample.sample_index))
        if len(order) == 11:
            others_done.set()

    class WaitForOthers(Tools):
        def __call__(self, partial):
            if (partial.prompt_id, partial.sample_index, model_turns(partial)) == slow:
                with self.lock:
                    self.calls.append(slow)
                return self.pool.submit(lambda: others_done.wait(30.0) and None)
            return super().__call__(partial)
    tools = WaitForOthers()
    s = multiturn_sampler()
    s.serve(model_params(0), next_request=_requests(), on_sample=on_sample, on_turn=tools)
    assert slow in tools.calls, "the slow episode must have paused after its first turn"
    assert others_done.is_set() and order[-1] == (10, 0)


def _requests():
    queue = [(pid, i, np.asarray(tokens, np.int32), MAX_NEW) for pid, tokens in PROMPTS
             for i in range(3)]
    return lambda: queue.pop(0) if queue else None


def test_ending_every_episode_at_its_first_turn_is_single_turn_sampling():
    s = multiturn_sampler()
    plain = s.generate(model_params(0), PROMPTS)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    ended = s.generate(model_params(0), PROMPTS, on_turn=lambda p: pool.submit(lambda: None))
    for a, b in zip(plain, ended):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert bits_equal(a.behavior_logp, b.behavior_logp)
        assert a.finish_reason == b.finish_reason and b.model_token_mask().all()


def test_an_observation_that_leaves_no_room_ends_the_episode_as_length():
    """A 3-token observation with 2 or fewer tokens left: not appended, finish "length"."""
    s = Sampler(CONFIG, contract(), sampling(max_new_tokens=MAX_NEW, stop_tokens=STOPS),
                num_slots=4, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4,
                max_observation_len=MAX_OBS)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    long_obs = np.asarray([20, 21, 22], np.int32)
    samples = s.generate(model_params(0), PROMPTS, on_turn=lambda p: pool.submit(lambda: long_obs),
                         max_new_tokens=[5] * len(PROMPTS))
    cut = [x for x in samples if x.finish_reason == "length" and x.model_token_mask()[-1]
           and x.tokens[-1] in STOPS]
    assert cut, "some episode must end its turn with fewer than 4 tokens of room"
    for x in samples:
        assert x.length <= 5
        if x.finish_reason == "length" and x.tokens[-1] in STOPS and x.model_token_mask()[-1]:
            assert x.length + 3 + 1 > 5   # 3 observation tokens + 1 model token did not fit


def test_an_observation_longer_than_the_sampler_allows_is_refused():
    s = multiturn_sampler()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    too_long = np.arange(20, 20 + MAX_OBS + 1, dtype=np.int32)
    with pytest.raises(ValueError, match="max_observation_len=3"):
        s.generate(model_params(0), PROMPTS, on_turn=lambda p: pool.submit(lambda: too_long))


def test_weight_swap_between_turns_recomputes_paused_episodes_kv():
    """With recompute_kv_on_swap, a swap while an episode waits for its tool recomputes that
    slot's cache too, so every model token's p_b equals the full forward under the weights of
    its own version."""
    params = {0: model_params(0), 1: model_params(1)}
    polls = [0]

    def poll():
        polls[0] += 1
        return (params[1], 1) if polls[0] == 6 else None
    tools = Tools(delays=lambda key: 0.02)
    s = multiturn_sampler(recompute_kv_on_swap=True)
    samples = s.generate(params[0], PROMPTS, on_turn=tools, poll_weights=poll)
    assert s.last_stats["refreshes"] == 1
    crossed = [x for x in samples if set(x.versions[x.model_token_mask()]) == {0, 1}]
    assert crossed, "some episode must hold tokens of both versions"
    count = len(samples)
    for version, p in params.items():
        logp = train_logprobs(p, samples, contract(), 1.0, order=range(count), batch=count,
                              length=MAX_PROMPT_LEN + MAX_NEW)
        for i, x in enumerate(samples):
            rows = x.model_token_mask() & (x.versions == version)
            assert bits_equal(x.behavior_logp[rows], logp[i][rows]), (version, i)


def test_precompile_covers_the_append_programs():
    from jrl.sampling import slots as slot_programs
    programs = (slot_programs.prefill, slot_programs.append, slot_programs.decode)
    # A spec no other test uses (steps_per_call=5, xla), so nothing of it is compiled yet.
    s = Sampler(CONFIG, contract("xla"), sampling(max_new_tokens=MAX_NEW, stop_tokens=STOPS),
                num_slots=4, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=5,
                max_observation_len=MAX_OBS)
    params = model_params(0)
    before = [p._cache_size() for p in programs]
    # Buckets 1, 2, 4 rows for prefill and for append, then decode: 7 programs.
    assert s.precompile(params) == 7
    assert [p._cache_size() - b for p, b in zip(programs, before)] == [3, 3, 1]
    compiled = [p._cache_size() for p in programs]
    samples = s.generate(params, PROMPTS, on_turn=Tools())
    assert len(samples) == 12 and s.last_stats["appends"] >= 4
    assert [p._cache_size() for p in programs] == compiled


def test_observations_need_a_sampler_built_for_them_and_ids_in_the_vocabulary():
    pool = concurrent.futures.ThreadPoolExecutor(2)
    single = Sampler(CONFIG, contract(), sampling(max_new_tokens=MAX_NEW, stop_tokens=STOPS),
                     num_slots=4, max_prompt_len=MAX_PROMPT_LEN)
    with pytest.raises(ValueError, match="max_observation_len > 0"):
        single.generate(model_params(0), PROMPTS, on_turn=lambda p: pool.submit(lambda: None))
    outside = np.asarray([CONFIG.vocab_size], np.int32)
    with pytest.raises(ValueError, match=r"observation token ids outside \[0, 32\)"):
        multiturn_sampler().generate(model_params(0), PROMPTS,
                                     on_turn=lambda p: pool.submit(lambda: outside))
