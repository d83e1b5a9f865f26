"""RunConfig: a run's name, seed and one section per part of the run, with the rules that span
sections, the values derived from them (seeds, optimizer length, the recipe's needs), and the
config of a saved config.json."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import NamedTuple

from jrl.checks import check_seed
from jrl.envs import ENVIRONMENTS
from jrl.kernels.contract import NumericalContract
from jrl.losses.recipes import Recipe
from jrl.pipeline.config.algorithm import AlgorithmSection, algorithm_recipe
from jrl.pipeline.config.data import DataSection
from jrl.pipeline.config.env import EnvSection
from jrl.pipeline.config.metrics import MetricsSection
from jrl.pipeline.config.migration import migrate_dict
from jrl.pipeline.config.model import ModelSection
from jrl.pipeline.config.rollout import RolloutSection, SamplingSection
from jrl.pipeline.config.tools import from_dict
from jrl.pipeline.config.train import (CheckpointSection, EvalSection, PipelineSection,
                                       TrainSection)
from jrl.sampling.params import SamplingParams
from jrl.train.optimizer import OptimizerConfig

# A run's name becomes a directory under runs/: one plain path component.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RunSeeds(NamedTuple):
    """Every seed of a run, resolved (RunConfig.seeds)."""

    train: int          # the train state's PRNG key and the mini-batch shuffles
    model_init: int     # model.init_seed: the random init (model.source="random")
    lora: int           # model.lora.seed: the adapters' init
    data: int           # data.seed: the task's problems, the prompt order, the warm start
    sampling: int       # sampling.seed: every sample's PRNG stream


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run: its name (the directory runs/<name> unless --workdir says otherwise), seed, and
    one section per part of the run (metrics: where its metrics go, MetricsSection).

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
    metrics: MetricsSection = MetricsSection()

    def __post_init__(self):
        if not (isinstance(self.name, str) and _PLAIN_NAME.fullmatch(self.name)) or \
                ".." in self.name:
            raise ValueError(f"name={self.name!r}: must be a plain name (letters, digits, '.', "
                             "'_', '-'; starting with a letter or digit; no '..'; at most 128 "
                             "characters): it names the run's directory runs/<name>")
        check_seed("seed", self.seed)
        if isinstance(self.sampling, SamplingParams):   # a plain one: the section of its fields
            object.__setattr__(self, "sampling", SamplingSection.from_params(self.sampling))
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
        return algorithm_recipe(self.algorithm, self.sampling.max_new_tokens)


def config_from_dict(data: dict, log: Callable[[str], None] = print) -> RunConfig:
    """The RunConfig of a config dict (a run's config.json): keys that have moved are read
    under their new names, one `log` line each (jrl.pipeline.config.migration); unknown keys
    and bad values raise ValueError naming the key."""
    data = copy.deepcopy(data)
    for note in migrate_dict(data):
        log(note)
    return from_dict(RunConfig, data)
