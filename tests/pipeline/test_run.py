"""End-to-end runs of the pipeline on a tiny model: metrics, checkpoints, bitwise resume."""

import json
import os

import jax
import numpy as np
import pytest

from jrl.pipeline.runner import Run
from tests.pipeline.tiny import tiny_config

REQUIRED_METRICS = (
    "rollout/reward_mean", "rollout/response_len_mean", "rollout/truncated_frac",
    "rollout/zero_std_groups_all_correct", "rollout/zero_std_groups_all_wrong",
    "rollout/staleness_mean", "rollout/staleness_max", "train/pg_clipfrac_low",
    "train/pg_clipfrac_high", "train/ppo_kl", "train/entropy", "train/grad_norm",
    "train/tis_mean", "train/tis_abs", "mismatch/logprob_abs_diff_max",
    "mismatch/numerical_abs", "mismatch/staleness_abs", "time/rollout_s", "time/train_s",
    "time/weight_sync_s", "time/wait_s",
)


def _quiet(*_):
    pass


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _equal_trees(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("full"))
    run = Run(tiny_config("train.steps=4"), workdir, log=lambda *_: None)
    return run.run(), workdir


def test_bitwise_end_to_end_run_metrics_and_checkpoints(full_run):
    result, workdir = full_run
    records = _records(workdir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # eval at 0, then every step
    for record in records[1:]:
        for name in REQUIRED_METRICS:
            assert name in record, name
        assert np.isfinite(record["train/loss"])
        # The headline property inside a real run: sampler p_b == trainer p_o, exactly.
        assert record["mismatch/logprob_abs_diff_max"] == 0.0
        assert record["mismatch/numerical_abs"] == 0.0
        assert record["rollout/staleness_max"] == 0  # synchronous: max_staleness 0
        # p_old = p_b and p_b == p_c before the update: ratio exactly 1 at the first update.
        assert record["train/ppo_kl"] == 0.0
        assert record["train/pg_clipfrac_low"] == record["train/pg_clipfrac_high"] == 0.0
    assert int(result.state.version) == 4 and int(result.state.step) == 4
    steps = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                   if d.isdigit())
    assert steps == [2, 4]
    assert "eval/accuracy" in records[-1]


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(full_run, tmp_path):
    result, _ = full_run
    workdir = str(tmp_path / "resumed")
    first = Run(tiny_config("train.steps=4"), workdir, log=lambda *_: None)
    first.run(steps=2)                       # stops after step 2 (checkpoint at 2)
    second = Run(tiny_config("train.steps=4"), workdir, resume=True, log=lambda *_: None)
    resumed = second.run()
    assert second.resumed_from == 2 and second.start_step == 4
    assert _equal_trees(resumed.state.params, result.state.params)
    assert _equal_trees(resumed.state.opt_state, result.state.opt_state)
    assert int(resumed.state.version) == int(result.state.version)
    # The metrics file continues without duplicates.
    assert [r["step"] for r in _records(workdir)] == [0, 1, 2, 3, 4]


def test_reward_function_errors_are_counted_not_fatal(tmp_path):
    calls = {"n": 0}

    def flaky(text, example):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("verifier crashed")
        return 1.0 if "#" in text else 0.0

    run = Run(tiny_config("train.steps=1", "train.sft_steps=0", "eval.greedy=false"),
              str(tmp_path), reward_fn=flaky, log=lambda *_: None)
    run.run()
    record = _records(str(tmp_path))[-1]
    assert record["rollout/reward_errors"] == 16 // 3  # calls 3, 6, ..., 15 of 16 samples


def test_reward_function_error_stops_the_run_when_asked(tmp_path):
    def broken(text, example):
        raise RuntimeError("verifier crashed")

    run = Run(tiny_config("train.steps=2", "train.sft_steps=0", "eval.greedy=false"),
              str(tmp_path), reward_fn=broken, raise_reward_errors=True, log=lambda *_: None)
    with pytest.raises(Exception, match="verifier crashed"):
        run.run()


def test_grpo_with_reference_kl_dynamic_sampling_and_corrections(tmp_path):
    # Every optional part in one short run: frozen reference + KL in the loss, p_old recomputed,
    # TIS and MIS against p_b, DAPO's dynamic sampling and overlong shaping.
    run = Run(tiny_config("train.steps=2", "loss.preset=grpo", "loss.kl_beta=0.04",
                          "train.reference=loss", "train.old_logp=recompute",
                          "loss.tis_cap=2.0", "loss.mis_threshold=2.0",
                          "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2",
                          "rollout.overlong_buffer=2", "eval.greedy=false"),
              str(tmp_path), log=_quiet,
              # A reward with spread inside groups, so dynamic sampling keeps some groups.
              reward_fn=lambda text, example: float(len(text) % 2))
    result = run.run()
    assert "KLPenalty(beta=0.04" in repr(run.loss_fn) and "TIS(cap=2.0" in repr(run.loss_fn)
    for record in run.history:
        assert np.isfinite(record["train/loss"]) and np.isfinite(record["train/ref_kl"])
        assert 1 <= record["rollout/sampling_rounds"] <= 2
        assert record["mismatch/logprob_abs_diff_max"] == 0.0
        assert record["rollout/groups_kept"] > 0
    # Step 1 trains the reference itself: KL exactly 0, and p_old = p_b: TIS weights exactly 1.
    assert run.history[0]["train/ref_kl"] == 0.0
    assert run.history[0]["train/tis_mean"] == 1.0
    assert result.state.version == 2


def test_eval_reports_verifier_and_format_free_accuracy(tmp_path):
    """eval/accuracy_greedy uses the run's verifier ("####" decides when present);
    eval/accuracy_greedy_last_number takes the response's last number, whatever the format."""
    from jrl.sampling import Sample

    run = Run(tiny_config("data.eval_size=4"), str(tmp_path), log=lambda *_: None)
    answers = [int(e.answer) for e in run.eval_examples]
    texts = [f"#### {answers[0]}",                       # verifier yes, last number yes
             f"#### {answers[1]}\n{answers[1] + 1}",     # verifier yes, last number no
             f"#### {answers[2]}\n{answers[2] + 1}",     # verifier yes, last number no
             "####"]                                      # neither
    # Expected: verifier 3/4 = 0.75, last number 1/4 = 0.25.

    def fake_generate(params, requests, **_):
        return [Sample(prompt_id=pid, sample_index=0, prompt_tokens=np.asarray(p, np.int32),
                       tokens=np.asarray(run.tokenizer.encode(text), np.int32),
                       behavior_logp=None, logit_floor=None, versions=None, entropy=None,
                       finish_reason="stop")
                for (pid, p), text in zip(requests, texts)]

    run.eval_sampler.generate = fake_generate
    out = run.evaluate()
    assert out["eval/accuracy_greedy"] == 0.75
    assert out["eval/accuracy_greedy_last_number"] == 0.25
