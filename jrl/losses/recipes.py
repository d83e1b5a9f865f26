"""An RL algorithm as one unit: advantage estimator + loss chain + reward shaping.

A paper's algorithm is more than its loss: Dr.GRPO is GRPO's clipped objective with *centred*
advantages (no std division) and a constant reduction; DAPO adds dynamic sampling and a soft
overlong penalty to its token-mean loss. A `Recipe` holds the three parts together, so that
naming an algorithm brings all of it:

    recipe = jrl.losses.recipes.dr_grpo(max_len=512)
    advantages = recipe.advantages(rewards, group_size)      # [B] -> [B], std_power=0
    loss, metrics = recipe.loss(inputs)                      # the chain
    recipe.shaping.overlong_buffer_len(max_len=512)          # 0: Dr.GRPO shapes nothing
    print(recipe)                                            # the whole algorithm, for logs

`RECIPES` is the one registry of algorithms, the registry a config's `algorithm.recipe` names;
`register_recipe` adds a research algorithm under a new name, and a config's
`algorithm.factory="package.module:function"` loads one. A recipe declares what its run needs
(`needs_reference`: a frozen reference policy for its KL term; `needs_behavior_logp`: the
sampler's p_b apart from p_old, for its TIS / MIS corrections); the run config derives
train.reference and train.old_logp from them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jrl.losses import presets
from jrl.losses._utils import Array, check_positive
from jrl.losses.advantages import group_advantages
from jrl.losses.chain import Chain
from jrl.losses.transforms import KLPenalty


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """A_i = (R_i - mean_g R) / (std_g R + eps) ** std_power over each group of G samples.

    std_power 1 is GRPO's normalisation, 0 Dr.GRPO's centring only (see group_advantages for
    the formula, the population / unbiased std choice and the constant-group rule).
    rewards [B] -> advantages [B] float32, stop-gradient.
    """

    std_power: float = 1.0
    unbiased: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        check_positive("GroupAdvantages", "std_power", self.std_power, allow_zero=True)
        check_positive("GroupAdvantages", "eps", self.eps, allow_zero=True)

    def __call__(self, rewards: Array, group_size: int) -> Array:
        return group_advantages(rewards, group_size, std_power=self.std_power, eps=self.eps,
                                unbiased=self.unbiased)

    def check_group_size(self, group_size: int) -> None:
        """Raises ValueError when group_size cannot give these advantages a signal: a group of
        one sample is its own mean, so every advantage R - mean_g R is 0 and nothing is learnt
        (and with unbiased=True the sample std of one reward is undefined too)."""
        if group_size < 2:
            why = " (and the unbiased sample std of one reward is undefined)" \
                if self.unbiased else ""
            raise ValueError(f"needs group_size >= 2: with groups of one sample every "
                             f"group-normalised advantage is 0 (R - mean of its own group), so "
                             f"the run cannot learn{why}")


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """What a recipe does to rewards and groups before the advantages.

    dynamic_sampling (DAPO): groups whose rewards do not vary carry no signal; drop them and
      sample more prompts. overlong_buffer_frac (DAPO's soft overlong punishment, eq. 13): a
      linear penalty up to -overlong_factor over the last fraction of the response budget
      (DAPO: 4096 of 20480 tokens = 0.2); 0 turns it off. overlong_buffer: the ramp's width in
      tokens instead of a fraction (set from a config's algorithm.overlong_buffer).
    """

    dynamic_sampling: bool = False
    overlong_buffer_frac: float = 0.0
    overlong_factor: float = 1.0
    overlong_buffer: int | None = None

    def __post_init__(self):
        if not 0.0 <= self.overlong_buffer_frac < 1.0:
            raise ValueError(f"RewardShaping.overlong_buffer_frac={self.overlong_buffer_frac!r}:"
                             " must be in [0, 1)")
        check_positive("RewardShaping", "overlong_factor", self.overlong_factor, allow_zero=True)
        if self.overlong_buffer is not None:
            check_positive("RewardShaping", "overlong_buffer", self.overlong_buffer,
                           allow_zero=True)

    def overlong_buffer_len(self, *, max_len: int) -> int:
        """The ramp's width in tokens for a response budget of max_len (0: no penalty)."""
        if self.overlong_buffer is not None:
            return int(self.overlong_buffer)
        return int(round(self.overlong_buffer_frac * max_len))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An RL algorithm: advantages [B] from rewards, the loss chain, and reward shaping."""

    name: str
    advantages: GroupAdvantages
    loss: Chain
    shaping: RewardShaping = RewardShaping()
    paper: str = ""

    @property
    def needs_reference(self) -> bool:
        """Whether the chain reads ref_logp, a frozen reference policy's: it has a KL term."""
        return any(isinstance(t, KLPenalty) for t in self.loss.transforms)

    @property
    def needs_behavior_logp(self) -> bool:
        """Whether the chain weighs p_old against the sampler's p_b (a correction stage: TIS,
        MIS), so p_old must be recomputed: with p_old = p_b the weight is exactly 1."""
        return any(getattr(t, "stage", None) == "correction" for t in self.loss.transforms)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        paper = f" [{self.paper}]" if self.paper else ""
        return (f"Recipe({self.name}{paper}: advantages={self.advantages!r}, "
                f"loss={self.loss!r}, shaping={self.shaping!r})")


RecipeFactory = Callable[..., Recipe]


def grpo(*, max_len: int | None = None, unbiased_std: bool = False, **loss_options) -> Recipe:
    """GRPO (DeepSeekMath, arXiv:2402.03300): group-normalised advantages (std_power 1), the
    token-ratio clipped objective with a per-sequence mean and a k3 KL (presets.grpo), no
    shaping. max_len is accepted for a uniform signature and unused."""
    del max_len
    return Recipe("grpo", GroupAdvantages(std_power=1.0, unbiased=unbiased_std),
                  presets.grpo(**loss_options), RewardShaping(), paper="arXiv:2402.03300")


def dapo(*, max_len: int | None = None, unbiased_std: bool = False, **loss_options) -> Recipe:
    """DAPO (arXiv:2503.14476): group-normalised advantages, clip-higher token-mean loss
    (presets.dapo), dynamic sampling and the soft overlong penalty over the last 20% of the
    response budget (the paper: 4096 of 20480 tokens)."""
    del max_len
    return Recipe("dapo", GroupAdvantages(std_power=1.0, unbiased=unbiased_std),
                  presets.dapo(**loss_options),
                  RewardShaping(dynamic_sampling=True, overlong_buffer_frac=0.2),
                  paper="arXiv:2503.14476")


def dr_grpo(*, max_len: int, unbiased_std: bool = False, **loss_options) -> Recipe:
    """Dr.GRPO (arXiv:2503.20783): advantages centred only (std_power 0: no std division, the
    question-level difficulty bias the paper removes) and the constant sum / (S * max_len)
    reduction (presets.dr_grpo: no length bias), no shaping."""
    return Recipe("dr_grpo", GroupAdvantages(std_power=0.0, unbiased=unbiased_std),
                  presets.dr_grpo(max_len, **loss_options), RewardShaping(),
                  paper="arXiv:2503.20783")


def gspo(*, max_len: int | None = None, unbiased_std: bool = False, **loss_options) -> Recipe:
    """GSPO (arXiv:2507.18071): group-normalised advantages, the sequence-ratio objective
    (presets.gspo), no shaping."""
    del max_len
    return Recipe("gspo", GroupAdvantages(std_power=1.0, unbiased=unbiased_std),
                  presets.gspo(**loss_options), RewardShaping(), paper="arXiv:2507.18071")


def cispo(*, max_len: int | None = None, unbiased_std: bool = False, **loss_options) -> Recipe:
    """CISPO (MiniMax-M1, arXiv:2506.13585): group-normalised advantages, the clipped-IS-weight
    objective with token-mean reduction (presets.cispo), no shaping."""
    del max_len
    return Recipe("cispo", GroupAdvantages(std_power=1.0, unbiased=unbiased_std),
                  presets.cispo(**loss_options), RewardShaping(), paper="arXiv:2506.13585")


RECIPES: dict[str, RecipeFactory] = {
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
}


def register_recipe(name: str, factory: RecipeFactory, *, replace: bool = False) -> None:
    """Adds `factory(max_len=..., **options) -> Recipe` to RECIPES under `name`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_recipe: name={name!r} must be an identifier")
    if name in RECIPES and not replace:
        raise ValueError(f"register_recipe: {name!r} is already registered; pass replace=True")
    if not callable(factory):
        raise ValueError(f"register_recipe: factory for {name!r} is not callable")
    RECIPES[name] = factory


def recipe(name: str, **options) -> Recipe:
    """`RECIPES[name](**options)`; a ValueError names the allowed recipes."""
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r}: allowed are {sorted(RECIPES)}")
    return RECIPES[name](**options)
