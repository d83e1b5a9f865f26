"""The papers' loss chains: GRPO, DAPO, Dr.GRPO, GSPO, CISPO as chains of jrl.losses.transforms.

These are the loss part of each algorithm; jrl.losses.recipes pairs each with its advantage
estimator and reward shaping (a config's `loss.preset` names a recipe). Every chain can carry a
KL term (`kl_beta > 0`) and an entropy bonus, reduced with the chain's own aggregation mode.
"""

from __future__ import annotations

from typing import Callable

from jrl.losses.chain import Chain, chain
from jrl.losses.transforms import (CISPO, Aggregate, EntropyBonus, KLPenalty, PPOClip,
                                   SequenceRatio, TokenRatio)


def _regularizers(kl_beta: float, kl_kind: str, kl_mode: str, entropy_coef: float,
                  kl_straight_through: bool = False,
                  kl_importance_weighted: bool = False, max_len: int | None = None) -> tuple:
    terms: tuple = ()
    if kl_beta:
        terms += (KLPenalty(beta=kl_beta, kind=kl_kind, mode=kl_mode, max_len=max_len,
                            straight_through=kl_straight_through,
                            importance_weighted=kl_importance_weighted),)
    elif kl_importance_weighted:
        raise ValueError("kl_importance_weighted=True needs a KL term: set kl_beta > 0.")
    if entropy_coef:
        terms += (EntropyBonus(coef=entropy_coef),)
    return terms


def grpo(
    *,
    eps: float = 0.2,
    kl_beta: float = 0.04,
    kl_kind: str = "k3",
    kl_straight_through: bool = False,
    kl_importance_weighted: bool = False,
    entropy_coef: float = 0.0,
    corrections: tuple = (),
) -> Chain:
    """GRPO (DeepSeekMath, arXiv:2402.03300): token ratio, symmetric clip eps 0.2,
    seq_mean_token_mean, k3 KL to the reference with beta 0.04 inside the same reduction.

    kl_beta=0 drops the KL term (then ref_logp is only logged if given). kl_straight_through:
    the estimator's value with k2's gradient (verl's "k3+"). kl_importance_weighted: the
    estimate times p_c / p_old (DeepSeek-V3.2's unbiased KL, slime's --use-unbiased-kl).
    Advantages: group_advantages(rewards, G) (std_power 1). `corrections`: e.g. (TIS(cap=2.0),)
    or (TIS(cap=2.0, level="sequence"),).
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps, eps_high=eps),
        Aggregate(mode="seq_mean_token_mean"),
        *_regularizers(kl_beta, kl_kind, "seq_mean_token_mean", entropy_coef,
                       kl_straight_through, kl_importance_weighted),
        name="grpo",
    )


def dapo(
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    kl_beta: float = 0.0,
    kl_kind: str = "k3",
    kl_straight_through: bool = False,
    kl_importance_weighted: bool = False,
    entropy_coef: float = 0.0,
    corrections: tuple = (),
) -> Chain:
    """DAPO (arXiv:2503.14476): clip-higher eps 0.2 / 0.28, token_mean, no KL term by default
    (the paper drops it; kl_beta > 0 adds one, token-mean reduced).

    DAPO's other two parts live outside the loss: dynamic sampling (`useful_groups`) and the
    soft overlong penalty (`overlong_penalty`, added to rewards); recipes.dapo() carries them.
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="token_mean"),
        *_regularizers(kl_beta, kl_kind, "token_mean", entropy_coef, kl_straight_through,
                       kl_importance_weighted),
        name="dapo",
    )


def dr_grpo(max_len: int, *, eps: float = 0.2, kl_beta: float = 0.0, kl_kind: str = "k3",
            kl_straight_through: bool = False, kl_importance_weighted: bool = False,
            entropy_coef: float = 0.0, corrections: tuple = ()) -> Chain:
    """Dr.GRPO (arXiv:2503.20783): symmetric clip eps 0.2, constant reduction
    sum / (num_sequences * max_len), no KL by default (kl_beta > 0 adds one, reduced the same
    constant way). Its advantages are centred only, group_advantages(..., std_power=0):
    recipes.dr_grpo() pairs them.
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps, eps_high=eps),
        Aggregate(mode="constant", max_len=max_len),
        *_regularizers(kl_beta, kl_kind, "constant", entropy_coef, kl_straight_through,
                       kl_importance_weighted, max_len=max_len),
        name="dr_grpo",
    )


def gspo(
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    token_grad: bool = False,
    kl_beta: float = 0.0,
    kl_kind: str = "k3",
    kl_straight_through: bool = False,
    kl_importance_weighted: bool = False,
    entropy_coef: float = 0.0,
    corrections: tuple = (),
) -> Chain:
    """GSPO (arXiv:2507.18071): geometric-mean sequence ratio, clip 3e-4 / 4e-4 (the paper's
    ranges; tiny because a sequence ratio moves far less than a token ratio), sequence mean
    (seq_mean_token_mean of a ratio constant along each sequence), no KL.
    token_grad=True gives GSPO-token. Clip fractions count tokens: a clipped sequence counts
    with all its tokens.
    """
    return chain(
        SequenceRatio(token_grad=token_grad),
        *corrections,
        PPOClip(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="seq_mean_token_mean"),
        *_regularizers(kl_beta, kl_kind, "seq_mean_token_mean", entropy_coef,
                       kl_straight_through, kl_importance_weighted),
        name="gspo-token" if token_grad else "gspo",
    )


def cispo(*, eps_low: float = 1.0, eps_high: float = 2.0, kl_beta: float = 0.0,
          kl_kind: str = "k3", kl_straight_through: bool = False,
          kl_importance_weighted: bool = False, entropy_coef: float = 0.0,
          corrections: tuple = ()) -> Chain:
    """CISPO (MiniMax-M1, arXiv:2506.13585): stop-gradient clipped IS weight on A * logp,
    token_mean (the paper normalises by the total token count), no KL by default. See CISPO
    for eps_high.
    """
    return chain(
        TokenRatio(),
        *corrections,
        CISPO(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="token_mean"),
        *_regularizers(kl_beta, kl_kind, "token_mean", entropy_coef, kl_straight_through,
                       kl_importance_weighted),
        name="cispo",
    )


PRESETS: dict[str, Callable[..., Chain]] = {
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
}
