"""SpeculativeConfig: how speculative decoding drafts, verifies and switches a draft off
(jrl.sampling.speculative runs it; jrl.sampling.drafts and jrl.sampling.draft_gate read it).
A frozen dataclass, hashable: it is part of the key of every compiled decode program."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jrl.checks import check_choice, check_range
from jrl.models.config import ModelConfig
from jrl.models.mtp import MtpHead

DRAFT_SOURCES = ("ngram", "draft_model", "mtp", "fast_path")
DELTANET_ROLLBACKS = ("settle", "refeed")
DRAFT_PICKS = ("draw", "argmax", "target_key")


class DraftModel(NamedTuple):
    """A draft model for `SpeculativeConfig(draft=DraftModel(config, params))`: config (any
    decoder jrl runs, with the target's vocab_size; a Gated DeltaNet draft pays one more draft
    forward per step) and its params. It runs under the target's numerical contract; its bits
    affect only which drafts are proposed, never the law or the p_b of the emitted tokens."""

    config: ModelConfig
    params: Any


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for `Sampler(speculative=...)` (hashable: part of the jit key).

    draft: where drafts come from, the one thing the Sampler's speculative= argument needs:
      "ngram" (prompt / n-gram lookup, no extra model); a DraftModel(config, params) (drawn
      drafts, accepted by rejection sampling); the target's multi-token-prediction head, a
      jrl.models.mtp.MtpHead(params); "fast_path" (the policy itself, its own weights under
      the fast, non-invariant contract `fast_path_contract`: self-speculative exact decoding;
      its draft cache costs one more KV cache of the policy's size, and no weights); or a
      DraftSource instance (hashable, e.g. a frozen dataclass) for a source of your own. The
      Sampler keeps a draft model's or head's weights and compiles against "draft_model" /
      "mtp" in their place (`without_weights`): the config is part of every program's key.
    draft_pick (draft="draft_model", "mtp" or "fast_path"; None: "target_key" for the fast
      path, "draw" for the others): "draw" samples each draft from the draft's own
      tempered, truncated distribution p and accepts it by rejection sampling (accept
      probability min(1, q/p): high when p is close to q); "argmax" proposes the draft's most
      likely token, a point mass accepted with probability q(d) by plain decoding's own draw,
      so the samples are plain decoding's bit for bit (fewer accepted drafts when q is not
      peaked); "target_key" draws each draft from the draft's tempered, truncated logits with
      the very key the target draws that token index with (truncation.sample_from_floor) and
      proposes it as a point mass: the samples are plain decoding's bit for bit, and a draft
      whose logits are close to the target's (the fast path's differ in rounding only) is
      accepted unless the two draws part. Greedy sampling always takes the argmax.
    num_draft: k, the most tokens drafted and verified per step (the verify pass is k + 1 wide).
    ngram_max / ngram_min: the longest and shortest suffix of the slot's tokens looked up in its
      own prompt + response; the longest suffix with an earlier occurrence wins, the latest
      occurrence of it, and its continuation (up to k known tokens) is the draft.
    deltanet_rollback (models with Gated DeltaNet layers): "settle" rolls their cache back to
      the kept tokens from the verify pass's own record (one forward per step; needs
      k + 1 <= contract.delta_chunk, else the step refeeds), "refeed" feeds the kept tokens
      again from the pre-verify cache (a second forward). Both give the same bits; refeed is
      the baseline of launch/bench_speed.py's hybrid pair.
    draft_catch_up (draft="draft_model" or "mtp"): the width of the draft's catch-up forward,
      which feeds it the history it has not seen (a prompt takes ceil(P / width) of them; the
      MTP head's per-step catch-up of the tokens the last step kept is k + 1 wide).
    draft_min_accept / draft_backoff (draft="draft_model" or "mtp"): a slot whose decayed
      acceptance rate (accepted / verified drafts) falls below draft_min_accept stops drafting for
      about draft_backoff steps, then probes again; each further poor probe doubles the pause
      (up to 2**5 x), and pauses end on common steps (multiples of the pause on a clock the
      slots share), so that slots probe together. A step where no slot drafts skips the draft
      model altogether: a draft that is rejected costs only its probes. A drafting step costs
      c plain steps and emits 1 + k * rate tokens, so drafting pays above rate (c - 1) / k: c
      was 3.1 on a 2-core CPU (0.53 at k = 4); a memory-bound accelerator's c is smaller. 0.0
      never switches off.
    """

    draft: "str | DraftModel | MtpHead | object" = "ngram"
    num_draft: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    deltanet_rollback: str = "settle"
    draft_catch_up: int = 16
    draft_min_accept: float = 0.5
    draft_backoff: int = 16
    draft_pick: str | None = None

    def __post_init__(self):
        if self.draft_pick is None:
            object.__setattr__(self, "draft_pick",
                               "target_key" if self.draft == "fast_path" else "draw")
        if isinstance(self.draft, (DraftModel, MtpHead)):
            pass
        elif not isinstance(self.draft, str):
            if not callable(getattr(self.draft, "propose", None)):
                raise ValueError(f"SpeculativeConfig.draft: a {type(self.draft).__name__} is "
                                 "none of 'ngram', 'fast_path', a DraftModel(config, params), "
                                 "an MtpHead(params) or a DraftSource (a propose(spec, params, "
                                 "state, num_draft, seed) method)")
        else:
            check_choice("SpeculativeConfig.draft", self.draft, DRAFT_SOURCES)
        check_range("SpeculativeConfig.draft_min_accept", self.draft_min_accept, low=0, high=1)
        for name in ("num_draft", "ngram_max", "ngram_min", "draft_catch_up", "draft_backoff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SpeculativeConfig.{name}={value!r}: must be a positive int")
        if self.draft_pick not in DRAFT_PICKS:
            raise ValueError(f"SpeculativeConfig.draft_pick={self.draft_pick!r}: allowed values "
                             f"are {list(DRAFT_PICKS)}")
        if self.draft_pick != "draw" and not self.keeps_draft_state:
            raise ValueError(f"SpeculativeConfig.draft_pick={self.draft_pick!r} is for "
                             "draft='draft_model', 'mtp' or 'fast_path' (the n-gram draft and a "
                             f"DraftSource pick their own drafts); got draft={self.draft!r}")
        check_choice("SpeculativeConfig.deltanet_rollback", self.deltanet_rollback,
                     DELTANET_ROLLBACKS)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpeculativeConfig.ngram_min={self.ngram_min} > ngram_max="
                             f"{self.ngram_max}")

    @property
    def uses_draft_model(self) -> bool:
        return isinstance(self.draft, DraftModel) or (isinstance(self.draft, str)
                                                      and self.draft == "draft_model")

    @property
    def uses_mtp(self) -> bool:
        return isinstance(self.draft, MtpHead) or (isinstance(self.draft, str)
                                                   and self.draft == "mtp")

    @property
    def uses_fast_path(self) -> bool:
        return isinstance(self.draft, str) and self.draft == "fast_path"

    @property
    def keeps_draft_state(self) -> bool:
        """The draft has a cache and a gate of its own in the slot state (a draft model, the
        MTP head or the fast path): steps run draft_model_step, chosen between two programs."""
        return self.uses_draft_model or self.uses_mtp or self.uses_fast_path


    def without_weights(self) -> "tuple[SpeculativeConfig, DraftModel | None, MtpHead | None]":
        """(this config with a draft model or MTP head replaced by "draft_model" / "mtp",
        which is hashable, the draft model, the head): the Sampler compiles against the first
        and passes the weights to its programs as arguments."""
        if isinstance(self.draft, DraftModel):
            return dataclasses.replace(self, draft="draft_model"), self.draft, None
        if isinstance(self.draft, MtpHead):
            return dataclasses.replace(self, draft="mtp"), None, self.draft
        return self, None, None


def fast_path_contract(contract):
    """The contract the fast path drafts under: the target's dtypes on the plain-XLA kernels
    (fused by XLA, not batch-invariant; its bits decide only which drafts are proposed)."""
    return contract.replace(backend="xla")
