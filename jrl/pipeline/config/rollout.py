"""The sampling and rollout sections of a run config: what is sampled per step, how fast, and
how it is rewarded."""

from __future__ import annotations

import dataclasses
import inspect

from jrl.checks import check_choice, check_positive, check_range, check_seed
from jrl.plugins import check_plugin_spec, load_plugin
from jrl.rewards import EXTRACT_MODES
from jrl.rewards.custom import CustomReward, parse_weights
from jrl.sampling.params import SamplingParams
from jrl.sampling.slots import PREFILL_BUCKETS
from jrl.sampling.speculative_config import DRAFT_PICKS


@dataclasses.dataclass(frozen=True)
class SamplingSection(SamplingParams):
    """The run config's sampling section: SamplingParams (below) whose seed may be left unset.
    seed None (the default) is the run's top-level seed (RunConfig.seeds). The samplers get a
    plain SamplingParams with the seed resolved (RunConfig.resolved_sampling). A RunConfig
    given a plain SamplingParams turns it into this section (from_params), reading its seed 0
    (SamplingParams' default, which cannot be left unset) as unset."""

    seed: int | None = None

    def __post_init__(self):
        if self.seed is not None:
            check_seed("sampling.seed", self.seed)
        # SamplingParams' own checks (and its list -> tuple of stop_tokens).
        checked = self.params(0)
        object.__setattr__(self, "stop_tokens", checked.stop_tokens)

    def params(self, run_seed: int) -> SamplingParams:
        """These parameters as a plain SamplingParams, seeded by this section's seed or, when it
        is None, by run_seed."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)}
        values["seed"] = run_seed if self.seed is None else self.seed
        return SamplingParams(**values)

    @classmethod
    def from_params(cls, params: SamplingParams) -> "SamplingSection":
        """The section of a plain SamplingParams: its fields, its seed unset when it is 0."""
        if isinstance(params, cls):
            return params
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
        values["seed"] = params.seed or None
        return cls(**values)


# --help-config sampling shows what every field means (no docstrings under python -OO).
if SamplingSection.__doc__ and SamplingParams.__doc__:
    SamplingSection.__doc__ = (inspect.getdoc(SamplingSection) + "\n\n"
                               + inspect.getdoc(SamplingParams))


@dataclasses.dataclass(frozen=True)
class SpeculativeSection:
    """rollout.speculative: speculative decoding that changes no bit of a sample's law and p_b
    (jrl.sampling.speculative; jrl.sampling.SpeculativeConfig is what the sampler gets).

    num_draft: k > 0 drafts up to k tokens per decode step and verifies them in one (k + 1)-wide
    pass; 0 (the default) is off. Gated DeltaNet models (Qwen3.5) roll their recurrent state
    back inside that pass when k + 1 <= the contract's delta_chunk (16 by default) and pay a
    second pass per step otherwise.
    draft: where drafts come from. "" (the default): n-gram lookup in the sample's own prompt
    and response (the longest suffix of at most ngram_max tokens). A draft model: a Hugging
    Face checkpoint directory or a .gguf file with the policy's vocabulary (a Qwen3.5 draft
    pays one more draft forward per step to roll its recurrent state back), or "smollm2" (the
    packaged SmolLM2-135M-Instruct, a draft for larger SmolLM2 policies); it stays frozen while
    the policy trains. "mtp" (a reserved name: write ./mtp for a directory called so): the
    policy checkpoint's own multi-token-prediction head (Qwen3.5's mtp.* tensors;
    model.source="hf"). "fast_path" (reserved like "mtp"): self-speculative exact decoding, the
    policy itself drafting on the plain-XLA kernels with the exact path's own sampling keys,
    verified by the exact path; the draft costs one more KV cache of the policy's size and no
    weights.
    ngram_max: the longest suffix the n-gram draft looks up.
    draft_min_accept: a sample whose drafts the policy accepts less often than this pauses
    drafting, probing again after 16, 32, .. steps (SpeculativeConfig.draft_min_accept; 0
    drafts at every step).
    draft_pick: "" (the source's default: "target_key" for the fast path, "draw" otherwise),
    "draw" (drafts drawn from the draft's distribution, accepted by rejection sampling: every
    token's law and p_b stay the policy's), "argmax" (a point mass: every sample is bit for bit
    plain decoding's, fewer drafts accepted) or "target_key" (a point mass drawn with the
    policy's own sampling key: bit for bit plain decoding's).

    Before this section, its fields were rollout.speculative (the number), speculative_ngram,
    speculative_draft, speculative_min_accept and speculative_draft_pick; a config.json or a
    --set override that names them is read under the new keys, with a note
    (jrl.pipeline.config.migration)."""

    num_draft: int = 0
    draft: str = ""
    ngram_max: int = 3
    draft_min_accept: float = 0.5
    draft_pick: str = ""

    def __post_init__(self):
        check_positive("rollout.speculative.num_draft", self.num_draft, allow_zero=True)
        check_positive("rollout.speculative.ngram_max", self.ngram_max)
        if self.draft and not self.num_draft:
            raise ValueError(f"rollout.speculative.draft={self.draft!r} needs "
                             "rollout.speculative.num_draft=k > 0 (the drafts per step)")
        check_range("rollout.speculative.draft_min_accept", self.draft_min_accept, low=0,
                    high=1)
        if self.draft_pick:
            check_choice("rollout.speculative.draft_pick", self.draft_pick, DRAFT_PICKS)
        if self.draft_pick not in ("", "draw") and not self.draft:
            raise ValueError(f"rollout.speculative.draft_pick={self.draft_pick!r} needs "
                             "rollout.speculative.draft (a draft model, 'mtp' or 'fast_path'); "
                             "the n-gram draft picks its own drafts")

    @property
    def enabled(self) -> bool:
        return self.num_draft > 0

    @property
    def source(self) -> str:
        """SpeculativeConfig.draft for this section: "ngram", "mtp", "fast_path" or
        "draft_model" (draft names a checkpoint)."""
        if self.draft in ("mtp", "fast_path"):
            return self.draft
        return "draft_model" if self.draft else "ngram"


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """prompts_per_step prompts x sampling.group_size samples per RL step, generated over
    num_slots continuous-batching slots. max_sampling_rounds: with dynamic sampling
    (algorithm.dynamic_sampling, DAPO's), the most sampling rounds one step spends replacing
    groups whose rewards do not vary (a compute budget; the rest of the batch then keeps them).
    precompile: compile every sampler program (each prefill bucket)
    before the first step instead of when a bucket is first needed mid-run (steady step times;
    short runs that never fill some buckets start faster without it).
    Faster rollouts that change no bit of a sample (jrl.sampling.prefix / .speculative):
    share_prefill: prefill each distinct prompt once and copy its cache into the slot of every
    sample of its group. speculative: speculative decoding (SpeculativeSection, below).
    prefill_buckets: "powers_of_two" (a batched prefill of k waiting prompts runs the next
    power of two of rows) or "one" (always num_slots rows: one program, fewer compiles, more
    padding rows); the same samples either way (Sampler.prefill_buckets).
    reward_mode / format_reward: the built-in math verifier's answer extraction ("auto",
    "hash", "boxed", "last_number") and format bonus. reward_fn: your own reward instead,
    "package.module:function" or "path/to/file.py:function", called as
    fn(response_text, example[, token_ids]) -> float | dict of named parts (jrl.rewards.custom;
    imported at setup, in every process that scores rollouts). reward_weights:
    "part=weight[,part=weight]" for a reward_fn returning named parts (a part not listed
    weighs 1), e.g. "correct=1,format=0.1"."""

    prompts_per_step: int = 16
    num_slots: int = 32
    max_prompt_len: int = 32
    steps_per_call: int = 16
    max_sampling_rounds: int = 3
    reward_mode: str = "auto"
    format_reward: float = 0.0
    reward_fn: str = ""
    reward_weights: str = ""
    precompile: bool = True
    share_prefill: bool = False
    speculative: SpeculativeSection = SpeculativeSection()
    prefill_buckets: str = "powers_of_two"

    def __post_init__(self):
        for name in ("prompts_per_step", "num_slots", "max_prompt_len", "steps_per_call",
                     "max_sampling_rounds"):
            check_positive(f"rollout.{name}", getattr(self, name))
        check_range("rollout.format_reward", self.format_reward)
        check_choice("rollout.reward_mode", self.reward_mode, EXTRACT_MODES)
        check_choice("rollout.prefill_buckets", self.prefill_buckets, PREFILL_BUCKETS)
        if self.reward_fn:
            check_plugin_spec("rollout.reward_fn", self.reward_fn)
            for name, default in (("reward_mode", "auto"), ("format_reward", 0.0)):
                if getattr(self, name) != default:
                    raise ValueError(f"rollout.{name}={getattr(self, name)!r} configures the "
                                     "built-in verifier, which rollout.reward_fn="
                                     f"{self.reward_fn!r} replaces: leave it unset")
        parse_weights("rollout.reward_weights", self.reward_weights)
        if self.reward_weights and not self.reward_fn:
            raise ValueError(f"rollout.reward_weights={self.reward_weights!r} weighs the named "
                             "parts of rollout.reward_fn, which is not set")

    def custom_reward(self) -> CustomReward | None:
        """rollout.reward_fn imported and wrapped with its weights (None when unset)."""
        if not self.reward_fn:
            return None
        return CustomReward(load_plugin("rollout.reward_fn", self.reward_fn),
                            parse_weights("rollout.reward_weights", self.reward_weights),
                            key=f"rollout.reward_fn={self.reward_fn!r}",
                            weights_key="rollout.reward_weights")

