"""Sampling parameters and the logprob semantics they imply."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the sampler draws tokens. Hashable: part of the jit cache key of the sampler.

    temperature: z = logits * f32(1 / temperature) (one multiply, identical on every backend);
      must be > 0 (greedy decoding is `greedy=True`).
    top_k: keep the k largest z (0 = off). top_p: keep the smallest top set whose probability
      reaches top_p (1.0 = off). Ties at the boundary are kept, so the kept set is a threshold
      `z >= floor`: the sampler records `floor` per token and the trainer replays it exactly.
    max_new_tokens: generation budget per sample. stop_tokens: ids that end a sample (the stop
      token is kept as the sample's last token and trained on).
    group_size: samples per prompt (a GRPO group). seed: root of every sample's PRNG stream,
      which is derived from (seed, prompt_id, sample_index, token index), so results do not
      depend on slot assignment or batch composition.
    greedy: argmax decoding (evaluation); logprobs are still reported under `temperature`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    group_size: int = 1
    seed: int = 0
    greedy: bool = False

    def __post_init__(self):
        if isinstance(self.stop_tokens, list):
            object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be a finite "
                             "number > 0 (use greedy=True for argmax decoding)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an int >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1] (1 = off)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be a "
                             "positive int")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"SamplingParams.group_size={self.group_size!r}: must be a "
                             "positive int")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or \
                not 0 <= self.seed < 2**32:
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be an int in [0, 2**32)")
        if not isinstance(self.stop_tokens, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_tokens):
            raise ValueError(f"SamplingParams.stop_tokens={self.stop_tokens!r}: must be token ids "
                             "(ints >= 0)")

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
