"""Metric names: the one place they are defined and documented.

Names are slash-separated "<section>/<quantity>" and stable: dashboards, plots (launch/plot.py) and
comparisons across runs key on them. Every value is a scalar per logged step. "Rows" are sampled
responses (B prompts x G samples); "groups" are a prompt's G responses.

| name                                | meaning                                                    |
|-------------------------------------|------------------------------------------------------------|
| rollout/reward_mean                 | mean reward over the step's rows (after shaping)           |
| rollout/reward_errors               | rows whose reward function raised or returned a non-finite |
|                                     | value (reward 0)                                           |
| rollout/response_len_mean           | mean response length in tokens                             |
| rollout/truncated_frac              | fraction of rows cut off at the max response length (no    |
|                                     | end-of-sequence)                                           |
| rollout/zero_std_groups_all_correct | groups whose rewards are all equal and correct (no         |
|                                     | gradient signal)                                           |
| rollout/zero_std_groups_all_wrong   | groups whose rewards are all equal and wrong (no gradient  |
|                                     | signal)                                                    |
| rollout/staleness_mean              | mean over tokens of (trainer version at consumption -      |
|                                     | token's version)                                           |
| rollout/staleness_max               | max of the same                                            |
| rollout/dropped_stale               | rows dropped because their staleness exceeded the allowed  |
|                                     | maximum                                                    |
| rollout/sampling_rounds             | sampling rounds the step took (dynamic sampling refills)   |
| rollout/groups_kept                 | groups in the train batch (dynamic sampling drops the      |
|                                     | zero-spread ones)                                          |
| train/loss                          | total objective value (pg_loss + kl_loss + entropy_loss)   |
| train/pg_loss                       | policy-gradient term of the loss                           |
| train/kl_loss                       | beta-scaled reference-KL term of the loss (0 without a KL  |
|                                     | term)                                                      |
| train/entropy_loss                  | entropy-bonus term of the loss (0 without one)             |
| train/lr                            | learning rate used by the step's optimizer update          |
| train/version                       | policy version after the step's updates                    |
| train/num_tokens                    | response tokens in the update's batch (the token-mean      |
|                                     | denominator)                                               |
| train/pg_clipfrac_low               | fraction of tokens where the lower clip 1 - eps_low was    |
|                                     | active                                                     |
| train/pg_clipfrac_high              | fraction of tokens where the upper clip 1 + eps_high was   |
|                                     | active                                                     |
| train/pg_clipfrac_dual              | fraction of tokens where the dual clip was active (only    |
|                                     | with dual-clip)                                            |
| train/ppo_kl                        | k1 estimate of KL(p_old, p_c): policy drift within the     |
|                                     | step's updates                                             |
| train/ratio_min                     | min over tokens of the policy ratio                        |
| train/ratio_mean                    | mean over tokens of the policy ratio                       |
| train/ratio_max                     | max over tokens of the policy ratio                        |
| train/ref_kl                        | token-mean KL estimate to the frozen reference policy      |
|                                     | (unscaled by beta)                                         |
| train/entropy                       | token-mean entropy of the current policy                   |
| train/grad_norm                     | global L2 norm of the gradient before clipping             |
| train/tis_mean                      | mean raw (untruncated) importance weight p_old / p_b (TIS) |
| train/tis_abs                       | mean abs(w - 1) of the same weights (a mean near 1 can     |
|                                     | hide drift)                                                |
| train/tis_clipfrac                  | fraction of tokens whose TIS weight was truncated          |
| train/mis_masked_frac               | fraction of tokens masked by MIS (weight outside its band) |
| mismatch/logprob_abs_diff_max       | max over tokens of abs(p_b - p_o), sampler vs trainer with |
|                                     | the same weights: exactly 0 with the Pallas backend, the   |
|                                     | invariant jrl is built on                                  |
| mismatch/numerical_abs              | mean abs(log p_o - log p_b): same weights, train engine vs |
|                                     | sampler (log r_num), on tokens whose version is still held |
| mismatch/staleness_abs              | mean abs(log p_c - log p_o): same engine, newer weights    |
|                                     | (log r_stale)                                              |
| mismatch/held_token_frac            | fraction of response tokens the two above were measured on |
| mismatch/kv_mixed_token_frac        | tokens generated after a weight swap on a KV cache kept    |
|                                     | from older weights: no single version reproduces them      |
| eval/accuracy                       | fraction of eval prompts answered correctly (the run's     |
|                                     | headline eval)                                             |
| eval/accuracy_greedy                | the same with greedy decoding (temperature 0)              |
| eval/accuracy_sampled               | the same with the training sampling parameters, averaged   |
|                                     | over samples                                               |
| eval/accuracy_greedy_last_number    | format-free greedy accuracy: the response's last number    |
|                                     | equals the answer, whatever the format (no "####" needed)  |
| eval/accuracy_sampled_last_number   | the same for the sampled eval                              |
| time/rollout_s                      | seconds spent generating the step's rollouts               |
| time/train_s                        | seconds spent in train step(s)                             |
| time/weight_sync_s                  | seconds spent copying weights from trainer to sampler      |
| time/wait_s                         | seconds the trainer waited for rollouts (async) or the     |
|                                     | sampler for weights                                        |
| time/step_s                         | wall seconds of the RL step on the trainer                 |
| time/train_idle_frac                | wait_s / step_s: the trainer's idle fraction               |
| time/rollout_idle_frac              | fraction of time the samplers had no admissible request    |
"""

from __future__ import annotations

ROLLOUT_REWARD_MEAN = "rollout/reward_mean"
ROLLOUT_REWARD_ERRORS = "rollout/reward_errors"
ROLLOUT_RESPONSE_LEN_MEAN = "rollout/response_len_mean"
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
ROLLOUT_ZERO_STD_GROUPS_ALL_CORRECT = "rollout/zero_std_groups_all_correct"
ROLLOUT_ZERO_STD_GROUPS_ALL_WRONG = "rollout/zero_std_groups_all_wrong"
ROLLOUT_STALENESS_MEAN = "rollout/staleness_mean"
ROLLOUT_STALENESS_MAX = "rollout/staleness_max"
ROLLOUT_DROPPED_STALE = "rollout/dropped_stale"
ROLLOUT_SAMPLING_ROUNDS = "rollout/sampling_rounds"
ROLLOUT_GROUPS_KEPT = "rollout/groups_kept"

TRAIN_LOSS = "train/loss"
TRAIN_PG_LOSS = "train/pg_loss"
TRAIN_KL_LOSS = "train/kl_loss"
TRAIN_ENTROPY_LOSS = "train/entropy_loss"
TRAIN_LR = "train/lr"
TRAIN_VERSION = "train/version"
TRAIN_NUM_TOKENS = "train/num_tokens"
TRAIN_PG_CLIPFRAC_LOW = "train/pg_clipfrac_low"
TRAIN_PG_CLIPFRAC_HIGH = "train/pg_clipfrac_high"
TRAIN_PG_CLIPFRAC_DUAL = "train/pg_clipfrac_dual"
TRAIN_PPO_KL = "train/ppo_kl"
TRAIN_RATIO_MIN = "train/ratio_min"
TRAIN_RATIO_MEAN = "train/ratio_mean"
TRAIN_RATIO_MAX = "train/ratio_max"
TRAIN_REF_KL = "train/ref_kl"
TRAIN_ENTROPY = "train/entropy"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_TIS_MEAN = "train/tis_mean"
TRAIN_TIS_ABS = "train/tis_abs"
TRAIN_TIS_CLIPFRAC = "train/tis_clipfrac"
TRAIN_MIS_MASKED_FRAC = "train/mis_masked_frac"

MISMATCH_LOGPROB_ABS_DIFF_MAX = "mismatch/logprob_abs_diff_max"
MISMATCH_NUMERICAL_ABS = "mismatch/numerical_abs"
MISMATCH_STALENESS_ABS = "mismatch/staleness_abs"
MISMATCH_HELD_TOKEN_FRAC = "mismatch/held_token_frac"
MISMATCH_KV_MIXED_TOKEN_FRAC = "mismatch/kv_mixed_token_frac"

EVAL_ACCURACY = "eval/accuracy"
EVAL_ACCURACY_GREEDY = "eval/accuracy_greedy"
EVAL_ACCURACY_SAMPLED = "eval/accuracy_sampled"
EVAL_ACCURACY_GREEDY_LAST_NUMBER = "eval/accuracy_greedy_last_number"
EVAL_ACCURACY_SAMPLED_LAST_NUMBER = "eval/accuracy_sampled_last_number"

TIME_ROLLOUT_S = "time/rollout_s"
TIME_TRAIN_S = "time/train_s"
TIME_WEIGHT_SYNC_S = "time/weight_sync_s"
TIME_WAIT_S = "time/wait_s"
TIME_STEP_S = "time/step_s"
TIME_TRAIN_IDLE_FRAC = "time/train_idle_frac"
TIME_ROLLOUT_IDLE_FRAC = "time/rollout_idle_frac"

ALL_METRIC_NAMES: tuple[str, ...] = tuple(
    value
    for key, value in sorted(globals().items())
    if key.isupper() and isinstance(value, str) and "/" in value
)
