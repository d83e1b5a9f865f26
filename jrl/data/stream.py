"""An endless, resumable, shardable stream of prompts: epochs over a list, shuffled per epoch."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from jrl.data.examples import PromptExample


def _check_int(where: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"{where}: {name}={value!r} is not allowed; it must be an int >= {minimum}."
        )


def _fingerprint(examples: Sequence[PromptExample]) -> str:
    """A short hash of the examples' ids, questions and answers: names the data a checkpoint saw."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(f"{example.id}\x1f{example.question}\x1f{example.answer}\x1e".encode("utf-8"))
    return digest.hexdigest()[:16]


class PromptStream:
    """Serves batches from `examples` in epochs, reshuffled each epoch, forever.

    Order: epoch e visits the examples in the permutation drawn by numpy's PCG64 seeded with
    SeedSequence([seed, e]) (identity if shuffle=False). The stream is the concatenation of the
    epochs, so a batch may end one epoch and start the next; nothing is dropped.

    Resuming: `state_dict()` is {"epoch", "index" (position within the epoch), "seed",
    "num_examples", "shuffle", "fingerprint"}; a stream built over the same examples and given
    that state by `load_state_dict` serves exactly the batches the saved one would have served.

    Multi-host: `shard(process_index, process_count)` returns a stream whose `next_batch(n)` is
    slice [process_index * n, (process_index + 1) * n) of the global batch of n * process_count
    that the unsharded stream would serve. Shards are disjoint within a step, all hosts see the
    same global order whatever process_count is, and the position is the global one, identical on
    every host, so one host's checkpoint restores them all.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        *,
        seed: int,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        where = "PromptStream"
        if len(examples) == 0:
            raise ValueError(f"{where}: examples is empty; a stream needs at least one example.")
        _check_int(where, "seed", seed, 0)
        _check_int(where, "process_count", process_count, 1)
        _check_int(where, "process_index", process_index, 0)
        if process_index >= process_count:
            raise ValueError(
                f"{where}: process_index={process_index} is not allowed; "
                f"it must be < process_count={process_count}."
            )
        if not isinstance(shuffle, bool):
            raise ValueError(f"{where}: shuffle={shuffle!r} is not allowed; it must be a bool.")
        self._examples = list(examples)
        self._seed = seed
        self._shuffle = shuffle
        self._process_index = process_index
        self._process_count = process_count
        self._epoch = 0
        self._index = 0
        self._order_epoch = -1
        self._order = np.arange(0)
        self._fingerprint: str | None = None

    @property
    def num_examples(self) -> int:
        return len(self._examples)

    @property
    def position(self) -> dict[str, int]:
        """{"epoch": e, "index": i}: the next global example is position i of epoch e's order."""
        return {"epoch": self._epoch, "index": self._index}

    @property
    def examples_consumed(self) -> int:
        """Global examples served so far (all hosts together): epoch * num_examples + index."""
        return self._epoch * len(self._examples) + self._index

    def shard(self, process_index: int, process_count: int) -> PromptStream:
        """This stream's share for one host (see the class docstring), at the same position."""
        if self._process_count != 1:
            raise ValueError(
                f"PromptStream.shard: this stream is already shard {self._process_index} of "
                f"{self._process_count}; shard the unsharded stream instead."
            )
        sharded = PromptStream(
            self._examples,
            seed=self._seed,
            shuffle=self._shuffle,
            process_index=process_index,
            process_count=process_count,
        )
        sharded._epoch, sharded._index = self._epoch, self._index
        sharded._fingerprint = self._fingerprint
        return sharded

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self._shuffle:
                rng = np.random.Generator(
                    np.random.PCG64(np.random.SeedSequence([self._seed, epoch]))
                )
                self._order = rng.permutation(len(self._examples))
            else:
                self._order = np.arange(len(self._examples))
            self._order_epoch = epoch
        return self._order

    def _take_global(self, count: int) -> list[PromptExample]:
        """The next `count` examples of the global stream; advances the position."""
        taken: list[PromptExample] = []
        while len(taken) < count:
            order = self._epoch_order(self._epoch)
            stop = min(len(order), self._index + count - len(taken))
            taken.extend(self._examples[int(i)] for i in order[self._index : stop])
            self._index = stop
            if self._index == len(order):
                self._epoch, self._index = self._epoch + 1, 0
        return taken

    def next_batch(self, n: int) -> list[PromptExample]:
        """This host's next `n` examples (n >= 1); every host must call it with the same n."""
        _check_int("PromptStream.next_batch", "n", n, 1)
        global_batch = self._take_global(n * self._process_count)
        return global_batch[self._process_index * n : (self._process_index + 1) * n]

    def state_dict(self) -> dict[str, Any]:
        """The position plus what identifies the stream; JSON-serialisable, same on every host."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self._examples)
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self._seed,
            "num_examples": len(self._examples),
            "shuffle": self._shuffle,
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves to a saved position; ValueError if the state was saved by a different stream.

        A state from a different seed, shuffle setting or example list would resume at a
        meaningless position, so every identifying field must match.
        """
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(
                f"PromptStream.load_state_dict: the state lacks fields {missing}; "
                f"got fields {sorted(state)}."
            )
        for field in ("seed", "num_examples", "shuffle", "fingerprint"):
            if state[field] != expected[field]:
                raise ValueError(
                    f"PromptStream.load_state_dict: state {field}={state[field]!r} does not "
                    f"match this stream's {field}={expected[field]!r}; the checkpoint was "
                    "written for different data or data options, so its position would not "
                    "resume the same prompts."
                )
        _check_int("PromptStream.load_state_dict", "epoch", state["epoch"], 0)
        _check_int("PromptStream.load_state_dict", "index", state["index"], 0)
        if state["index"] >= len(self._examples):
            raise ValueError(
                f"PromptStream.load_state_dict: index={state['index']!r} is not allowed; "
                "it must be < "
                f"num_examples={len(self._examples)}."
            )
        self._epoch, self._index = state["epoch"], state["index"]
