"""The metrics registry: each metric's name, meaning and reduction, declared once.

Names are slash-separated "<section>/<quantity>" and stable: dashboards, plots (jrl/cli/plot.py) and
comparisons across runs key on them. Every value is a scalar per logged step. "Rows" are sampled
responses (B prompts x G samples); "groups" are a prompt's G responses. Producers use the constants
below, never string literals; `table()` renders the registry as a markdown table (README).

The reduction says how the values of one quantity measured on PARTS of a batch combine
(micro-batches of an update, the hosts' shares of a rollout): SUM for partial sums and counts,
MEAN for averages (weighted by the parts' sizes), MAX / MIN for extremes. Successive updates of one
RL step are separate measurements: `combine_updates` keeps MAX / MIN and averages the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

SUM, MEAN, MAX, MIN = "sum", "mean", "max", "min"
REDUCTIONS = (SUM, MEAN, MAX, MIN)


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    reduce: str
    meaning: str


REGISTRY: dict[str, Metric] = {}
# Families of names with a user-chosen last part ("<prefix><name>"): one declaration each.
FAMILIES: dict[str, Metric] = {}


def metric(name: str, reduce: str, meaning: str) -> str:
    """Declares a metric (once) and returns its name."""
    if name in REGISTRY:
        raise ValueError(f"metric {name!r} is declared twice")
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric {name!r}: reduce={reduce!r} is not one of {REDUCTIONS}")
    REGISTRY[name] = Metric(name, reduce, meaning)
    return name


ROLLOUT_REWARD_MEAN = metric("rollout/reward_mean", MEAN,
    "mean reward over the step's rows (after shaping)")
ROLLOUT_REWARD_ERRORS = metric("rollout/reward_errors", SUM,
    "rows whose reward function raised or returned a non-finite value (reward 0)")
ROLLOUT_RESPONSE_LEN_MEAN = metric("rollout/response_len_mean", MEAN,
    "mean response length in tokens (model tokens: a multi-turn episode's observations excluded)")
ROLLOUT_TURNS_MEAN = metric("rollout/turns_mean", MEAN,
    "multi-turn episodes: mean model turns per episode")
ROLLOUT_TOOL_CALLS_MEAN = metric("rollout/tool_calls_mean", MEAN,
    "multi-turn episodes: mean tool calls per episode")
ROLLOUT_TOOL_ERRORS = metric("rollout/tool_errors", SUM,
    "multi-turn episodes: environment steps that failed (bad tool input, an exception)")
ROLLOUT_TOOL_TIMEOUTS = metric("rollout/tool_timeouts", SUM,
    "multi-turn episodes: environment calls past env.timeout_s")
ROLLOUT_OBSERVATION_TOKEN_FRAC = metric("rollout/observation_token_frac", MEAN,
    "multi-turn episodes: fraction of response tokens that are observations (not trained on)")
ROLLOUT_TURN_BUDGET_FRAC = metric("rollout/turn_budget_frac", MEAN,
    "multi-turn episodes: fraction ended by env.max_turns before the environment was done")
ROLLOUT_TRUNCATED_FRAC = metric("rollout/truncated_frac", MEAN,
    "fraction of rows cut off at the max response length (no end-of-sequence)")
ROLLOUT_ZERO_STD_GROUPS_ALL_CORRECT = metric("rollout/zero_std_groups_all_correct", SUM,
    "groups whose rewards are all equal and correct (no gradient signal)")
ROLLOUT_ZERO_STD_GROUPS_ALL_WRONG = metric("rollout/zero_std_groups_all_wrong", SUM,
    "groups whose rewards are all equal and wrong (no gradient signal)")
ROLLOUT_STALENESS_MEAN = metric("rollout/staleness_mean", MEAN,
    "mean over tokens of (trainer version at consumption - token's version)")
ROLLOUT_STALENESS_MAX = metric("rollout/staleness_max", MAX, "max of the same")
ROLLOUT_DROPPED_STALE = metric("rollout/dropped_stale", SUM,
    "rows dropped because their staleness exceeded the allowed maximum")
ROLLOUT_SAMPLING_ROUNDS = metric("rollout/sampling_rounds", MAX,
    "sampling rounds the step took (dynamic sampling refills)")
ROLLOUT_GROUPS_KEPT = metric("rollout/groups_kept", SUM,
    "groups in the train batch (dynamic sampling drops the zero-spread ones)")
ROLLOUT_SPEC_ACCEPT_RATE = metric("rollout/spec_accept_rate", MEAN,
    "speculative decoding: drafted tokens the target accepted / drafted tokens")
ROLLOUT_SPEC_TOKENS_PER_STEP = metric("rollout/spec_tokens_per_step", MEAN,
    "speculative decoding: model tokens emitted per slot per decode step (1 without drafts)")

TRAIN_LOSS = metric("train/loss", SUM, "total objective value (pg_loss + kl_loss + entropy_loss)")
TRAIN_PG_LOSS = metric("train/pg_loss", SUM, "policy-gradient term of the loss")
TRAIN_KL_LOSS = metric("train/kl_loss", SUM,
    "beta-scaled reference-KL term of the loss (0 without a KL term)")
TRAIN_ENTROPY_LOSS = metric("train/entropy_loss", SUM,
    "entropy-bonus term of the loss (0 without one)")
TRAIN_LR = metric("train/lr", MEAN, "learning rate used by the step's optimizer update")
TRAIN_VERSION = metric("train/version", MAX, "policy version after the step's updates")
TRAIN_NUM_TOKENS = metric("train/num_tokens", SUM,
    "response tokens in the update's batch (the token-mean denominator)")
TRAIN_UPDATE_SKIPPED = metric("train/update_skipped", MAX,
    "1 if an update of the step had a non-finite loss or gradient and was skipped (params kept)")
TRAIN_EXCLUDED_TOKENS = metric("train/excluded_tokens", SUM,
    "sampled tokens left out of the loss: the train engine gives them logprob -inf")
TRAIN_PG_CLIPFRAC_LOW = metric("train/pg_clipfrac_low", MEAN,
    "fraction of tokens where the lower clip 1 - eps_low was active")
TRAIN_PG_CLIPFRAC_HIGH = metric("train/pg_clipfrac_high", MEAN,
    "fraction of tokens where the upper clip 1 + eps_high was active")
TRAIN_PG_CLIPFRAC_DUAL = metric("train/pg_clipfrac_dual", MEAN,
    "fraction of tokens where the dual clip was active (only with dual-clip)")
TRAIN_PPO_KL = metric("train/ppo_kl", MEAN,
    "k1 estimate of KL(p_old, p_c): policy drift within the step's updates")
TRAIN_RATIO_MIN = metric("train/ratio_min", MIN, "min over tokens of the policy ratio")
TRAIN_RATIO_MEAN = metric("train/ratio_mean", MEAN, "mean over tokens of the policy ratio")
TRAIN_RATIO_MAX = metric("train/ratio_max", MAX, "max over tokens of the policy ratio")
TRAIN_REF_KL = metric("train/ref_kl", MEAN,
    "token-mean KL estimate to the frozen reference policy (unscaled by beta)")
TRAIN_ENTROPY = metric("train/entropy", MEAN, "token-mean entropy of the current policy")
TRAIN_GRAD_NORM = metric("train/grad_norm", MEAN, "global L2 norm of the gradient before clipping")
TRAIN_TIS_MEAN = metric("train/tis_mean", MEAN,
    "mean raw (untruncated) importance weight p_old / p_b (TIS)")
TRAIN_TIS_ABS = metric("train/tis_abs", MEAN,
    "mean abs(w - 1) of the same weights (a mean near 1 can hide drift)")
TRAIN_TIS_CLIPFRAC = metric("train/tis_clipfrac", MEAN,
    "fraction of tokens whose TIS weight was truncated")
TRAIN_MIS_MASKED_FRAC = metric("train/mis_masked_frac", MEAN,
    "fraction of tokens masked by MIS (weight outside its band)")
TRAIN_EXPERT_LOAD_MAX = metric("train/expert_load_max", MAX,
    "MoE: the most loaded expert's share of routed (token, slot) pairs over the mean share 1/E, "
    "in the worst layer, train forward under the current weights (1 = balanced)")
TRAIN_LOAD_BALANCE_LOSS = metric("train/load_balance_loss", SUM,
    "MoE: the auxiliary load-balancing term of the loss, coef * E * sum_e f_e P_e (0 without "
    "one)")

MISMATCH_LOGPROB_ABS_DIFF_MAX = metric("mismatch/logprob_abs_diff_max", MAX,
    "max over tokens of abs(p_b - p_o), sampler vs trainer with the same weights: "
    "exactly 0 with the Pallas backend, the invariant jrl is built on")
MISMATCH_NUMERICAL_ABS = metric("mismatch/numerical_abs", MEAN,
    "mean abs(log p_o - log p_b): same weights, train engine vs sampler (log "
    "r_num), on tokens whose version is still held")
MISMATCH_STALENESS_ABS = metric("mismatch/staleness_abs", MEAN,
    "mean abs(log p_c - log p_o): same engine, newer weights (log r_stale)")
MISMATCH_HELD_TOKEN_FRAC = metric("mismatch/held_token_frac", MEAN,
    "fraction of response tokens the two above were measured on")
MISMATCH_KV_MIXED_TOKEN_FRAC = metric("mismatch/kv_mixed_token_frac", MEAN,
    "tokens generated after a weight swap on a KV cache kept from older weights: "
    "no single version reproduces them")
MISMATCH_ROUTING_AGREEMENT = metric("mismatch/routing_agreement", MEAN,
    "MoE: fraction of (model token, MoE layer) pairs whose expert set is the same in the "
    "sampler and the train forward under the weights that routed the token: exactly 1 with the "
    "Pallas backend")
MISMATCH_ROUTING_STALE_FLIP_FRAC = metric("mismatch/routing_stale_flip_frac", MEAN,
    "MoE: fraction of the same pairs whose expert set under the current weights differs from "
    "under the routing weights (train forward both times): flips from staleness alone")
MISMATCH_ROUTING_PAIRS = metric("mismatch/routing_pairs", SUM,
    "MoE: (model token, MoE layer) pairs the two above were measured on")

EVAL_ACCURACY = metric("eval/accuracy", MEAN,
    "fraction of eval prompts answered correctly (the run's headline eval)")
EVAL_ACCURACY_GREEDY = metric("eval/accuracy_greedy", MEAN,
    "the same with greedy decoding (temperature 0)")
EVAL_ACCURACY_SAMPLED = metric("eval/accuracy_sampled", MEAN,
    "the same with the training sampling parameters, averaged over samples")
EVAL_ACCURACY_GREEDY_LAST_NUMBER = metric("eval/accuracy_greedy_last_number", MEAN,
    "format-free greedy accuracy: the response's last number equals the answer, "
    "whatever the format (no '####' needed)")
EVAL_ACCURACY_SAMPLED_LAST_NUMBER = metric("eval/accuracy_sampled_last_number", MEAN,
    "the same for the sampled eval")
EVAL_TOOL_CALLS_MEAN = metric("eval/tool_calls_mean", MEAN,
    "multi-turn episodes: mean tool calls per held-out episode (greedy if run, else sampled)")
EVAL_REWARD_ERRORS = metric("eval/reward_errors", SUM,
    "eval responses whose reward function raised or returned a non-number (counted wrong)")

TIME_ROLLOUT_S = metric("time/rollout_s", MAX, "seconds spent generating the step's rollouts")
TIME_TRAIN_S = metric("time/train_s", MAX, "seconds spent in train step(s)")
TIME_PREPARE_S = metric("time/prepare_s", MAX,
                        "seconds spent preparing the batch: packing, the train engine's p_o and "
                        "reference logprobs, advantages")
TIME_WEIGHT_SYNC_S = metric("time/weight_sync_s", MAX,
    "seconds spent copying weights from trainer to sampler")
TIME_WAIT_S = metric("time/wait_s", MAX,
    "seconds the trainer waited for rollouts (async) or the sampler for weights")
TIME_STEP_S = metric("time/step_s", MAX, "wall seconds of the RL step on the trainer")
TIME_TRAIN_IDLE_FRAC = metric("time/train_idle_frac", MEAN,
    "wait_s / step_s: the trainer's idle fraction")
TIME_ROLLOUT_IDLE_FRAC = metric("time/rollout_idle_frac", MEAN,
    "fraction of time the samplers had no admissible request")
TIME_GENERATE_S = metric("time/generate_s", MAX,
    "split processes: seconds the rollout process spent generating the step's "
    "batch")
TIME_BATCH_EXCHANGE_S = metric("time/batch_exchange_s", MAX,
    "split processes: seconds the batch took from the rollout process to the "
    "train process")
TIME_WEIGHT_EXCHANGE_S = metric("time/weight_exchange_s", MAX,
    "split processes: seconds the weights took from the train process to the "
    "rollout process")

SFT_LOSS = metric("sft/loss", MEAN, "warm start: token-mean cross-entropy of the step's batch")

ALL_METRIC_NAMES: tuple[str, ...] = tuple(sorted(REGISTRY))


def family(prefix: str, reduce: str, meaning: str) -> str:
    """Declares a family of metrics named prefix + a user's name; returns the prefix."""
    if prefix in FAMILIES or not prefix.endswith("/"):
        raise ValueError(f"metric family {prefix!r}: declared twice or not ending in '/'")
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric family {prefix!r}: reduce={reduce!r} is not one of "
                         f"{REDUCTIONS}")
    FAMILIES[prefix] = Metric(prefix + "<name>", reduce, meaning)
    return prefix


ROLLOUT_REWARD_PART = family(
    "rollout/reward_part/", MEAN,
    "mean over rows of the reward function's named part <name> (a reward returning a dict; "
    "the reward is their weighted sum, rollout.reward_weights)")


def reward_part(name: str) -> str:
    """The metric name of a reward function's named part."""
    return ROLLOUT_REWARD_PART + name


def reduction(name: str) -> str:
    """The declared reduction of `name` (KeyError naming the registry for an undeclared one)."""
    try:
        return REGISTRY[name].reduce
    except KeyError:
        for prefix, declared in FAMILIES.items():
            if name.startswith(prefix) and len(name) > len(prefix):
                return declared.reduce
        raise KeyError(f"metric {name!r} is not declared in jrl.metrics.names; declare it there "
                       "with metric(name, reduce, meaning)") from None


def combine_parts(records: Sequence[Mapping[str, float]],
                  weights: Sequence[float] | None = None) -> dict[str, float]:
    """One record from records measured on parts of one batch (host values).

    SUM adds, MAX / MIN take the extreme, MEAN averages weighted by `weights` (the parts' sizes;
    equal weights when None). Every record must hold the same names.
    """
    w = np.ones(len(records)) if weights is None else np.asarray(weights, np.float64)
    out = {}
    for name in records[0]:
        values = [r[name] for r in records]
        how = reduction(name)
        if how == SUM:
            out[name] = sum(values)
        elif how == MAX:
            out[name] = max(values)
        elif how == MIN:
            out[name] = min(values)
        else:
            out[name] = float(np.average(values, weights=w)) if w.sum() > 0 else \
                float(np.mean(values))
    return out


def combine_updates(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One record for an RL step from its successive updates' records: MAX / MIN metrics keep
    their extreme, every other metric is the mean over updates."""
    out = {}
    for name in records[0]:
        values = [float(r[name]) for r in records]
        how = reduction(name)
        out[name] = max(values) if how == MAX else min(values) if how == MIN else \
            float(np.mean(values))
    return out


def table() -> str:
    """The registry as a markdown table: name, reduction, meaning."""
    lines = ["| name | reduction | meaning |", "|---|---|---|"]
    lines += [f"| {m.name} | {m.reduce} | {m.meaning} |"
              for m in (*REGISTRY.values(), *FAMILIES.values())]
    return "\n".join(lines)
