"""The record of one generated response (`Sample`), what its decoding took (`DecodeCounts`) and
the values of its finish_reason. Every layer above sampling reads it; the sampler
(jrl.sampling.engine) writes it."""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class DecodeCounts:
    """What decoding one sample took, with speculative decoding on (Sample.spec): drafted
    tokens, drafts accepted, tokens emitted by decode steps (the first token comes from the
    prefill) and the decode steps the sample was live in."""

    drafted: int
    accepted: int
    emitted: int
    steps: int


@dataclasses.dataclass
class Sample:
    """One generated response. Per-token arrays have length `len(tokens)`."""

    prompt_id: int
    sample_index: int
    prompt_tokens: np.ndarray      # [P] int32
    tokens: np.ndarray             # [N] int32, stop token included when finish_reason == "stop"
    behavior_logp: np.ndarray      # [N] float32, p_b under the distribution sampled from
    logit_floor: np.ndarray        # [N] float32, truncation floor to replay (-inf: none)
    versions: np.ndarray           # [N] int32, policy version that produced each token
    entropy: np.ndarray | None     # [N] float32 if requested
    finish_reason: str             # "stop" or "length"
    # Multi-turn episodes: [N] bool, True where the model drew the token, False at appended
    # observation tokens (p_b 0, floor -inf, version -1; never trained on). None: all model.
    model_mask: np.ndarray | None = None
    # What the multi-turn driver recorded about the episode (jrl.pipeline.rollout.episodes).
    episode: object | None = None
    # MoE models: the experts of each token in each MoE layer (layer order), as the sampler
    # routed it when it fed the token, i.e. in the forward that produced the next model token
    # (whose version they share): experts [N, L_moe, k] int32 for the response, prompt_experts
    # [P, L_moe, k] for the prompt. -1 where the token was never fed (the response's last
    # token: nothing was computed from it). Observation tokens of multi-turn episodes are fed,
    # so they carry their routes too. None for dense models.
    experts: np.ndarray | None = None
    prompt_experts: np.ndarray | None = None
    # Speculative decoding's counters for this sample (None when speculation is off).
    spec: DecodeCounts | None = None

    @property
    def length(self) -> int:
        """Response tokens, observations included."""
        return int(self.tokens.shape[0])

    def model_token_mask(self) -> np.ndarray:
        """[N] bool: the tokens the model drew (all of them outside multi-turn episodes)."""
        if self.model_mask is None:
            return np.ones((self.length,), bool)
        return np.asarray(self.model_mask, bool)

    @property
    def num_model_tokens(self) -> int:
        return int(self.model_token_mask().sum())
