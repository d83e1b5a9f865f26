"""The algorithm section of a run config, and the recipe it builds (jrl.losses.recipes)."""

from __future__ import annotations

import dataclasses

from jrl import losses
from jrl.checks import check_choice, check_positive, check_range
from jrl.losses.kl import KL_KINDS
from jrl.losses.off_policy import MIS_LEVELS
from jrl.losses.recipes import RECIPES, GroupAdvantages, Recipe, RewardShaping
from jrl.plugins import check_plugin_spec, load_plugin


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
    (jrl.pipeline.config.migration)."""

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
        check_choice("algorithm.recipe", self.recipe, sorted(RECIPES))
        check_positive("algorithm.load_balance_coef", self.load_balance_coef, allow_zero=True)
        if self.factory is not None:
            check_plugin_spec("algorithm.factory", self.factory)
        if self.std_power is not None:
            check_range("algorithm.std_power", self.std_power, low=0)
        if self.eps_low is not None:
            check_range("algorithm.eps_low", self.eps_low, low=0, high=1)
        if self.eps_high is not None:
            check_range("algorithm.eps_high", self.eps_high, low=0)
        if self.overlong_buffer is not None:
            check_positive("algorithm.overlong_buffer", self.overlong_buffer, allow_zero=True)
        if self.overlong_factor is not None:
            check_range("algorithm.overlong_factor", self.overlong_factor, low=0)
        if self.tis_cap is not None:
            check_range("algorithm.tis_cap", self.tis_cap, low=0, low_open=True)
        if self.mis_threshold is not None:
            check_range("algorithm.mis_threshold", self.mis_threshold, low=0, low_open=True)
        check_range("algorithm.entropy_coef", self.entropy_coef, low=0)
        check_choice("algorithm.kl_kind", self.kl_kind, KL_KINDS)
        check_choice("algorithm.mis_level", self.mis_level, MIS_LEVELS)
        check_choice("algorithm.tis_level", self.tis_level, MIS_LEVELS)
        check_range("algorithm.kl_beta", self.kl_beta, low=0)
        if self.kl_importance_weighted and self.kl_beta == 0:
            raise ValueError("algorithm.kl_importance_weighted=True needs a KL term: set "
                             "algorithm.kl_beta > 0 (it weights the KL penalty's per-token "
                             "estimate)")
        if self.kl_importance_weighted and self.kl_straight_through:
            raise ValueError("algorithm.kl_importance_weighted=True and "
                             "algorithm.kl_straight_through=True exclude each other; set one")



def algorithm_recipe(spec: AlgorithmSection, max_len: int) -> Recipe:
    """The section's recipe (RunConfig.recipe): algorithm.recipe's (or algorithm.factory's)
    recipe with the clip bounds, terms and TIS / MIS corrections, and the overrides of its
    advantages (std_power, unbiased_std) and shaping (dynamic_sampling, overlong_buffer,
    overlong_factor); max_len: sampling.max_new_tokens."""
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

