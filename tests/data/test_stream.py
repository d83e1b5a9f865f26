import json

import pytest

from jrl.data import PromptExample, PromptStream, group_ids, repeat_for_groups

EXAMPLES = [PromptExample(id=i, question=f"q{i}", answer=str(i)) for i in range(10)]


def ids(batch):
    return [example.id for example in batch]


def test_epochs_cover_every_example_and_reshuffle():
    stream = PromptStream(EXAMPLES, seed=0)
    epoch0 = ids(stream.next_batch(4) + stream.next_batch(4) + stream.next_batch(2))
    epoch1 = ids(stream.next_batch(10))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert stream.position == {"epoch": 2, "index": 0}
    assert stream.examples_consumed == 20


def test_batch_crosses_epoch_boundary_without_dropping():
    stream = PromptStream(EXAMPLES, seed=3)
    reference = PromptStream(EXAMPLES, seed=3)
    flat = ids(reference.next_batch(30))
    assert ids(stream.next_batch(7) + stream.next_batch(7) + stream.next_batch(16)) == flat
    assert stream.position == {"epoch": 3, "index": 0}


def test_no_shuffle_is_file_order():
    stream = PromptStream(EXAMPLES, seed=0, shuffle=False)
    assert ids(stream.next_batch(12)) == list(range(10)) + [0, 1]


def test_resume_from_state_dict_sees_the_same_prompts():
    stream = PromptStream(EXAMPLES, seed=5)
    stream.next_batch(13)
    state = json.loads(json.dumps(stream.state_dict()))  # survives a JSON checkpoint
    expected = ids(stream.next_batch(25))
    resumed = PromptStream(EXAMPLES, seed=5)
    resumed.load_state_dict(state)
    assert ids(resumed.next_batch(25)) == expected


@pytest.mark.parametrize(
    "stream_kwargs, examples, message",
    [
        ({"seed": 6}, EXAMPLES, "seed=5 does not match this stream's seed=6"),
        ({"seed": 5, "shuffle": False}, EXAMPLES, "shuffle=True does not match"),
        ({"seed": 5}, EXAMPLES[:9], "num_examples=10 does not match"),
        (
            {"seed": 5},
            EXAMPLES[:9] + [PromptExample(id=9, question="other", answer="9")],
            "fingerprint=",
        ),
    ],
)
def test_state_from_another_stream_is_rejected(stream_kwargs, examples, message):
    state = PromptStream(EXAMPLES, seed=5).state_dict()
    with pytest.raises(ValueError, match=message):
        PromptStream(examples, **stream_kwargs).load_state_dict(state)


def test_bad_state_fields():
    stream = PromptStream(EXAMPLES, seed=0)
    state = stream.state_dict()
    with pytest.raises(ValueError, match=r"lacks fields \['index'\]"):
        stream.load_state_dict({k: v for k, v in state.items() if k != "index"})
    with pytest.raises(ValueError, match="index=10"):
        stream.load_state_dict({**state, "index": 10})


def test_shards_partition_the_global_batch():
    unsharded = PromptStream(EXAMPLES, seed=1)
    base = PromptStream(EXAMPLES, seed=1)
    base.next_batch(3)
    unsharded.next_batch(3)
    shards = [base.shard(i, 3) for i in range(3)]
    for _ in range(5):
        global_batch = ids(unsharded.next_batch(2 * 3))
        per_host = [ids(shard.next_batch(2)) for shard in shards]
        assert sum(per_host, []) == global_batch  # disjoint slices, in host order
    assert len({str(shard.state_dict()) for shard in shards}) == 1  # same position on every host
    assert shards[0].state_dict() == unsharded.state_dict()


def test_sharded_resume():
    shard = PromptStream(EXAMPLES, seed=2).shard(1, 2)
    shard.next_batch(3)
    state = shard.state_dict()
    expected = ids(shard.next_batch(4))
    resumed = PromptStream(EXAMPLES, seed=2).shard(1, 2)
    resumed.load_state_dict(state)
    assert ids(resumed.next_batch(4)) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": -1}, "seed=-1"),
        ({"seed": 0, "process_index": 2, "process_count": 2}, "process_index=2"),
        ({"seed": 0, "process_count": 0}, "process_count=0"),
        ({"seed": 0, "shuffle": 1}, "shuffle=1"),
    ],
)
def test_bad_stream_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptStream(EXAMPLES, **kwargs)


def test_bad_calls():
    with pytest.raises(ValueError, match="examples is empty"):
        PromptStream([], seed=0)
    with pytest.raises(ValueError, match="n=0"):
        PromptStream(EXAMPLES, seed=0).next_batch(0)
    with pytest.raises(ValueError, match="already shard 0 of 2"):
        PromptStream(EXAMPLES, seed=0).shard(0, 2).shard(0, 2)


def test_grouping():
    assert repeat_for_groups(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]
    assert group_ids(2, 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert group_ids(2, 3).dtype.name == "int32"
    with pytest.raises(ValueError, match="group_size=0"):
        repeat_for_groups(["a"], 0)
