"""jrl.losses: pure, jit-able loss functions for RL on language models, and their composition.

Flat public API. Math functions (each usable alone) take [B, T] per-token arrays with an explicit
[B, T] mask, or [B] per-sequence arrays, compute in float32, and document which inputs carry
gradient. `chain(...)` composes transforms into `loss_fn(inputs) -> (loss, metrics)`;
`grpo()`, `dapo()`, `dr_grpo()`, `gspo()`, `cispo()` are the papers' loss chains, and
`recipes.grpo()` ... `recipes.cispo()` the whole algorithms (advantages + chain + reward
shaping; `RECIPES`, the one registry of algorithms, is what a config's algorithm.recipe names).
"""

from jrl.losses.advantages import group_advantages
from jrl.losses.balance import load_balance_loss
from jrl.losses.aggregation import (
    AGGREGATION_MODES,
    aggregate,
    normalizer_for,
    num_sequences,
    num_tokens,
)
from jrl.losses.chain import METRIC_NAMES, STAGES, Chain, ChainState, LossInputs, chain, init_state
from jrl.losses.presets import Regularization, cispo, dapo, dr_grpo, grpo, gspo
from jrl.losses import recipes
from jrl.losses.recipes import (RECIPES, GroupAdvantages, Recipe, RewardShaping, recipe,
                                register_recipe)
from jrl.losses.transforms import (
    CISPO,
    MIS,
    TIS,
    Aggregate,
    EntropyBonus,
    LoadBalance,
    KLPenalty,
    PPOClip,
    SequenceRatio,
    TokenRatio,
)
from jrl.losses.clipping import (
    CISPOObjective,
    ClippedObjective,
    cispo_objective,
    clipped_objective,
)
from jrl.losses.cross_entropy import CrossEntropy, cross_entropy, token_entropy, token_logp
from jrl.losses.filtering import UsefulGroups, useful_groups
from jrl.losses.kl import KL_KINDS, importance_weighted_kl, kl_estimate
from jrl.losses.off_policy import MIS_LEVELS, MISMask, TISWeights, mis_mask, tis_weights
from jrl.losses.ratios import (
    DEFAULT_LOG_RATIO_CLIP,
    sequence_log_ratio,
    sequence_ratio,
    sequence_ratio_token,
    token_ratio,
)
from jrl.losses.shaping import overlong_penalty

__all__ = [
    # advantages, shaping, filtering
    "group_advantages",
    "overlong_penalty",
    "useful_groups",
    "UsefulGroups",
    # ratios
    "token_ratio",
    "sequence_log_ratio",
    "sequence_ratio",
    "sequence_ratio_token",
    "DEFAULT_LOG_RATIO_CLIP",
    # objectives
    "clipped_objective",
    "ClippedObjective",
    "cispo_objective",
    "CISPOObjective",
    # reductions
    "aggregate",
    "normalizer_for",
    "num_tokens",
    "num_sequences",
    "AGGREGATION_MODES",
    # KL, off-policy
    "kl_estimate",
    "importance_weighted_kl",
    "KL_KINDS",
    "tis_weights",
    "TISWeights",
    "mis_mask",
    "MISMask",
    "MIS_LEVELS",
    # supervised
    "cross_entropy",
    "CrossEntropy",
    "token_logp",
    "token_entropy",
    # composition
    "LossInputs",
    "chain",
    "Chain",
    "ChainState",
    "init_state",
    "STAGES",
    "METRIC_NAMES",
    "TokenRatio",
    "SequenceRatio",
    "TIS",
    "MIS",
    "PPOClip",
    "CISPO",
    "Aggregate",
    "KLPenalty",
    "EntropyBonus",
    "LoadBalance",
    "load_balance_loss",
    # the recipes' loss chains
    "Regularization",
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "RECIPES",
    "GroupAdvantages",
    "Recipe",
    "RewardShaping",
    "recipe",
    "recipes",
    "register_recipe",
]
