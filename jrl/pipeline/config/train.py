"""The train, eval, checkpoint and pipeline sections of a run config: how the train side
updates, measures, saves, and meets the rollout side."""

from __future__ import annotations

import dataclasses

from jrl.checks import check_choice, check_int, check_positive, check_range

OLD_LOGP_SOURCES = ("behavior", "recompute")
REFERENCE_MODES = ("none", "loss", "reward")
KV_ON_SWAP = ("keep", "recompute")


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
            check_positive(f"train.{name}", getattr(self, name))
        check_positive("train.sft_steps", self.sft_steps, allow_zero=True)
        check_range("train.sft_learning_rate", self.sft_learning_rate, low=0)
        check_range("train.kl_reward_coef", self.kl_reward_coef, low=0)
        check_choice("train.old_logp", self.old_logp, ("auto",) + OLD_LOGP_SOURCES)
        check_choice("train.reference", self.reference, ("auto",) + REFERENCE_MODES)

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
        check_positive("eval.every", self.every, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Orbax checkpoint every `every` RL steps (0 = only at the end); keep the last `keep`."""

    every: int = 0
    keep: int = 2

    def __post_init__(self):
        check_positive("checkpoint.every", self.every, allow_zero=True)
        check_positive("checkpoint.keep", self.keep)


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
        check_positive("pipeline.max_staleness", self.max_staleness, allow_zero=True)
        check_positive("pipeline.rollout_devices", self.rollout_devices, allow_zero=True)
        check_positive("pipeline.train_devices", self.train_devices, allow_zero=True)
        check_positive("pipeline.queue_size", self.queue_size)
        if self.drop_stale_beyond is not None:
            check_int("pipeline.drop_stale_beyond", self.drop_stale_beyond, low=0)
        check_positive("pipeline.keep_versions", self.keep_versions)
        check_choice("pipeline.kv_on_swap", self.kv_on_swap, KV_ON_SWAP)
        check_positive("pipeline.train_mesh_data", self.train_mesh_data)
        check_positive("pipeline.train_mesh_tensor", self.train_mesh_tensor)
        if self.train_devices and self.train_devices % (self.train_mesh_data *
                                                        self.train_mesh_tensor):
            raise ValueError(
                f"pipeline.train_devices={self.train_devices} is not divisible by "
                f"pipeline.train_mesh_data * pipeline.train_mesh_tensor = "
                f"{self.train_mesh_data * self.train_mesh_tensor}")

