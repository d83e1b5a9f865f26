"""The papers' loss chains: GRPO, DAPO, Dr.GRPO, GSPO, CISPO as chains of jrl.losses.transforms.

These are the loss part of each algorithm; jrl.losses.recipes pairs each with its advantage
estimator and reward shaping, and its RECIPES is the one registry of algorithms (a config's
`algorithm.recipe` names one). Every chain takes the same two clip bounds, eps_low and
eps_high, with one meaning: the ratio (the chain's token or sequence ratio; CISPO's IS weight)
is clipped to [1 - eps_low, 1 + eps_high]; a chain only chooses their defaults. Every chain can
carry the same KL term and entropy bonus (`Regularization`, given as its keywords), reduced with
the chain's own aggregation mode.
"""

from __future__ import annotations

import dataclasses

from jrl.losses._utils import check_choice, check_positive
from jrl.losses.chain import Chain, chain
from jrl.losses.kl import KL_KINDS
from jrl.losses.transforms import (CISPO, Aggregate, EntropyBonus, KLPenalty, PPOClip,
                                   SequenceRatio, TokenRatio)


@dataclasses.dataclass(frozen=True)
class Regularization:
    """The KL and entropy terms any chain may carry, appended after its aggregation.

    kl_beta > 0 adds KLPenalty(beta=kl_beta, kind=kl_kind) against the reference policy (0: no
    KL term; then ref_logp is only logged if given). kl_straight_through: the estimator's value
    with k2's gradient (verl's "k3+"). kl_importance_weighted: the estimate times p_c / p_old
    (DeepSeek-V3.2's unbiased KL, slime's --use-unbiased-kl); needs kl_beta > 0.
    entropy_coef > 0 adds EntropyBonus(coef=entropy_coef).
    """

    kl_beta: float = 0.0
    kl_kind: str = "k3"
    kl_straight_through: bool = False
    kl_importance_weighted: bool = False
    entropy_coef: float = 0.0

    def __post_init__(self):
        check_positive("Regularization", "kl_beta", self.kl_beta, allow_zero=True)
        check_positive("Regularization", "entropy_coef", self.entropy_coef, allow_zero=True)
        check_choice("Regularization", "kl_kind", self.kl_kind, KL_KINDS)
        if self.kl_importance_weighted and not self.kl_beta:
            raise ValueError("kl_importance_weighted=True needs a KL term: set kl_beta > 0.")

    def terms(self, mode: str, max_len: int | None = None) -> tuple:
        """The regularizer transforms, reduced with aggregation `mode` (and max_len)."""
        terms: tuple = ()
        if self.kl_beta:
            terms += (KLPenalty(beta=self.kl_beta, kind=self.kl_kind, mode=mode,
                                max_len=max_len, straight_through=self.kl_straight_through,
                                importance_weighted=self.kl_importance_weighted),)
        if self.entropy_coef:
            terms += (EntropyBonus(coef=self.entropy_coef),)
        return terms


def _chain(name: str, ratio, corrections: tuple, objective, mode: str,
           regularization: Regularization, max_len: int | None = None) -> Chain:
    return chain(ratio, *corrections, objective, Aggregate(mode=mode, max_len=max_len),
                 *regularization.terms(mode, max_len), name=name)


def grpo(*, eps_low: float = 0.2, eps_high: float = 0.2, corrections: tuple = (),
         **regularization) -> Chain:
    """GRPO (DeepSeekMath, arXiv:2402.03300): token ratio, symmetric clip 0.2 / 0.2,
    seq_mean_token_mean, k3 KL to the reference with beta 0.04 inside the same reduction
    (`regularization`: Regularization's keywords; kl_beta=0 drops the KL term).
    Advantages: group_advantages(rewards, G) (std_power 1). `corrections`: e.g. (TIS(cap=2.0),)
    or (TIS(cap=2.0, level="sequence"),).
    """
    return _chain("grpo", TokenRatio(), corrections, PPOClip(eps_low=eps_low, eps_high=eps_high),
                  "seq_mean_token_mean", Regularization(**{"kl_beta": 0.04, **regularization}))


def dapo(*, eps_low: float = 0.2, eps_high: float = 0.28, corrections: tuple = (),
         **regularization) -> Chain:
    """DAPO (arXiv:2503.14476): clip-higher eps 0.2 / 0.28, token_mean, no KL term by default
    (the paper drops it; kl_beta > 0 adds one, token-mean reduced).

    DAPO's other two parts live outside the loss: dynamic sampling (`useful_groups`) and the
    soft overlong penalty (`overlong_penalty`, added to rewards); recipes.dapo() carries them.
    """
    return _chain("dapo", TokenRatio(), corrections, PPOClip(eps_low=eps_low, eps_high=eps_high),
                  "token_mean", Regularization(**regularization))


def dr_grpo(max_len: int, *, eps_low: float = 0.2, eps_high: float = 0.2,
            corrections: tuple = (), **regularization) -> Chain:
    """Dr.GRPO (arXiv:2503.20783): symmetric clip 0.2 / 0.2, constant reduction
    sum / (num_sequences * max_len), no KL by default (kl_beta > 0 adds one, reduced the same
    constant way). Its advantages are centred only, group_advantages(..., std_power=0):
    recipes.dr_grpo() pairs them.
    """
    return _chain("dr_grpo", TokenRatio(), corrections,
                  PPOClip(eps_low=eps_low, eps_high=eps_high), "constant",
                  Regularization(**regularization), max_len=max_len)


def gspo(*, eps_low: float = 3e-4, eps_high: float = 4e-4, token_grad: bool = False,
         corrections: tuple = (), **regularization) -> Chain:
    """GSPO (arXiv:2507.18071): geometric-mean sequence ratio, clip 3e-4 / 4e-4 (the paper's
    ranges; tiny because a sequence ratio moves far less than a token ratio), sequence mean
    (seq_mean_token_mean of a ratio constant along each sequence), no KL.
    token_grad=True gives GSPO-token. Clip fractions count tokens: a clipped sequence counts
    with all its tokens.
    """
    return _chain("gspo-token" if token_grad else "gspo", SequenceRatio(token_grad=token_grad),
                  corrections, PPOClip(eps_low=eps_low, eps_high=eps_high),
                  "seq_mean_token_mean", Regularization(**regularization))


def cispo(*, eps_low: float = 1.0, eps_high: float = 2.0, corrections: tuple = (),
          **regularization) -> Chain:
    """CISPO (MiniMax-M1, arXiv:2506.13585): stop-gradient IS weight clipped to
    [1 - eps_low, 1 + eps_high] on A * logp (eps_low 1: no lower bound), token_mean (the paper
    normalises by the total token count), no KL by default. See CISPO for eps_high.
    """
    return _chain("cispo", TokenRatio(), corrections, CISPO(eps_low=eps_low, eps_high=eps_high),
                  "token_mean", Regularization(**regularization))
