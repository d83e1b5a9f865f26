from jrl.metrics import ALL_METRIC_NAMES, names

# The "Metric names" section of DESIGN.md plus the names added with the metrics package.
DESIGN_NAMES = """
rollout/reward_mean rollout/response_len_mean rollout/truncated_frac
rollout/zero_std_groups_all_correct rollout/zero_std_groups_all_wrong rollout/staleness_mean
rollout/staleness_max train/pg_clipfrac_low train/pg_clipfrac_high train/ppo_kl train/ref_kl
train/entropy train/grad_norm train/tis_mean train/tis_abs train/tis_clipfrac train/mis_masked_frac
mismatch/logprob_abs_diff_max mismatch/numerical_abs mismatch/staleness_abs eval/accuracy
time/rollout_s time/train_s time/weight_sync_s time/wait_s
rollout/reward_errors rollout/dropped_stale eval/accuracy_greedy eval/accuracy_sampled
train/loss train/lr
""".split()


def test_every_design_name_has_a_constant():
    assert set(DESIGN_NAMES) <= set(ALL_METRIC_NAMES)


def test_every_name_is_documented_in_the_table():
    table_rows = [
        line.split("|")[1].strip() for line in names.__doc__.splitlines() if line.startswith("| ")
    ]
    assert sorted(name for name in table_rows if name) == sorted(ALL_METRIC_NAMES + ("name",))


def test_names_are_unique_and_slash_separated():
    assert len(set(ALL_METRIC_NAMES)) == len(ALL_METRIC_NAMES)
    assert all(name.count("/") == 1 and name == name.lower() for name in ALL_METRIC_NAMES)
