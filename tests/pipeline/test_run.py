"""End-to-end runs of the pipeline on a tiny model: metrics, checkpoints, bitwise resume."""

import json
import os

import jax
import numpy as np
import pytest

from jrl.pipeline.loop.runner import Run
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


def test_a_run_records_its_platforms_contract(full_run, tmp_path):
    """The config's contract ("auto", class-default tiles) runs as the platform's
    (NumericalContract.resolved_for): config.json and the checkpoints record it, and a resume
    whose contract differs is refused, naming the field."""
    from jrl.kernels.contract import NumericalContract
    _, workdir = full_run
    with open(os.path.join(workdir, "config.json")) as f:
        recorded = NumericalContract.from_dict(json.load(f)["numerics"])
    assert recorded == NumericalContract.for_platform(jax.default_backend())
    with open(os.path.join(workdir, "checkpoints", "4", "meta", "metadata")) as f:
        assert NumericalContract.from_dict(json.load(f)["numerics"]) == recorded
    import shutil
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    mine = recorded.matmul_block_m * 2
    with pytest.raises(ValueError, match=f"matmul_block_m: {recorded.matmul_block_m} != {mine}"):
        Run(tiny_config("train.steps=5", f"numerics.matmul_block_m={mine}"), copy, resume=True,
            log=_quiet)


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
    # summary.json spans the resume: its first eval is the one before the interruption.
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 4 and summary["first_eval"]["step"] == 0
    assert summary["last_eval"]["step"] == 4


def test_summary_json_names_the_evals_the_recipe_and_the_contract(full_run):
    result, workdir = full_run
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")}
             for r in _records(workdir) if "eval/accuracy" in r]
    assert len(evals) >= 2                      # step 0 and the last step at least
    assert summary["steps"] == 4 and summary["first_eval"] == evals[0]
    assert summary["last_eval"] == evals[-1]
    # The best: the highest accuracy, the earliest step on a tie.
    best = max(evals, key=lambda r: (r["eval/accuracy"], -r["step"]))
    assert summary["best_eval"] == best
    assert summary["recipe"].startswith("Recipe(dapo")           # tiny_config's preset
    assert summary["contract"]["platform"] == "cpu"              # resolved at start
    assert summary["model"] == {"source": "random", "path": None, "model_type": "llama"}


def test_reward_function_errors_are_counted_not_fatal(tmp_path):
    calls = {"n": 0}

    def flaky(text, example):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("verifier crashed")
        return 1.0 if "#" in text else 0.0

    logged = []
    run = Run(tiny_config("train.steps=1", "train.sft_steps=0", "eval.greedy=false"),
              str(tmp_path), reward_fn=flaky, log=logged.append)
    run.run()
    record = _records(str(tmp_path))[-1]
    assert record["rollout/reward_errors"] == 16 // 3  # calls 3, 6, ..., 15 of 16 samples
    # 5 of 16 rows > 10%: a warning with the first failure (the group's third call).
    warning = [line for line in logged if line.startswith("warning: step 1")]
    assert warning and "5 reward calls failed" in warning[0]
    assert "index 2 (example id" in warning[0] and "RuntimeError: verifier crashed" in warning[0]


def test_a_raising_reward_function_is_counted_at_eval_too(tmp_path):
    """The eval runs the reward function under the rollout's guard: a verifier that always
    raises gives accuracy 0 and eval/reward_errors = eval_size (4) per eval, and the run ends."""
    def broken(text, example):
        raise RuntimeError("verifier crashed")

    run = Run(tiny_config("train.steps=1", "train.sft_steps=0"), str(tmp_path),
              reward_fn=broken, log=lambda *_: None)
    result = run.run()
    records = _records(str(tmp_path))
    for record in (records[0], records[-1]):         # the step-0 eval and the final one
        assert record["eval/reward_errors"] == 4 and record["eval/accuracy_greedy"] == 0.0
    assert records[-1]["rollout/reward_errors"] == 16
    assert result.final_eval["eval/reward_errors"] == 4


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
    run = Run(tiny_config("train.steps=2", "algorithm.recipe=grpo", "algorithm.kl_beta=0.04",
                          "train.reference=loss", "train.old_logp=recompute",
                          "algorithm.tis_cap=2.0", "algorithm.mis_threshold=2.0",
                          "algorithm.dynamic_sampling=true", "rollout.max_sampling_rounds=2",
                          "algorithm.overlong_buffer=2", "eval.greedy=false"),
              str(tmp_path), log=_quiet,
              # A reward with spread inside groups, so dynamic sampling keeps some groups.
              reward_fn=lambda text, example: float(len(text) % 2))
    result = run.run()
    loss = repr(run.trainer.loss_fn)
    assert "KLPenalty(beta=0.04" in loss and "TIS(cap=2.0" in loss
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
    answers = [int(e.answer) for e in run.parts.eval_examples]
    texts = [f"#### {answers[0]}",                       # verifier yes, last number yes
             f"#### {answers[1]}\n{answers[1] + 1}",     # verifier yes, last number no
             f"#### {answers[2]}\n{answers[2] + 1}",     # verifier yes, last number no
             "####"]                                      # neither
    # Expected: verifier 3/4 = 0.75, last number 1/4 = 0.25.

    def fake_generate(params, requests, **_):
        return [Sample(prompt_id=pid, sample_index=0, prompt_tokens=np.asarray(p, np.int32),
                       tokens=np.asarray(run.task.tokenizer.encode(text), np.int32),
                       behavior_logp=None, logit_floor=None, versions=None, entropy=None,
                       finish_reason="stop")
                for (pid, p), text in zip(requests, texts)]

    run.parts.eval_sampler.generate = fake_generate
    out = run.evaluate()
    assert out["eval/accuracy_greedy"] == 0.75
    assert out["eval/accuracy_greedy_last_number"] == 0.25


def _interrupt_on_call(owner, name, call_number):
    """Makes owner.name raise KeyboardInterrupt on its call_number-th call."""
    original, calls = getattr(owner, name), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call_number:
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    setattr(owner, name, wrapped)


@pytest.mark.parametrize("where", ["rollout", "train_step", "after_update"])
def test_interrupt_inside_a_step_saves_the_last_finished_step(full_run, tmp_path, where):
    """Ctrl-C during step 3 (waiting for its rollout, inside its train step, or after its update
    while publishing the weights) checkpoints step 2 with step 2's state, and the resumed run
    equals the uninterrupted one bitwise."""
    result, _ = full_run
    workdir = str(tmp_path / where)
    run = Run(tiny_config("train.steps=4", "checkpoint.every=0"), workdir, log=_quiet)
    if where == "rollout":
        _interrupt_on_call(run.worker, "next_batch", 3)
    elif where == "train_step":
        _interrupt_on_call(run.trainer, "train_on", 3)
    else:   # publishes: before step 1, after steps 1, 2, 3 -> the 4th follows step 3's update
        _interrupt_on_call(run.step, "publish", 4)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert run.trainer.checkpointer.all_steps() == [2]
    meta = run.trainer.checkpointer.read_meta()
    assert meta["rl_step"] == 2 and meta["version"] == 2
    run.close()
    resumed = Run(tiny_config("train.steps=4"), workdir, resume=True, log=_quiet)
    final = resumed.run()
    resumed.close()
    assert resumed.resumed_from == 2
    assert int(final.state.version) == int(result.state.version) == 4
    assert _equal_trees(final.state.params, result.state.params)
    assert _equal_trees(final.state.opt_state, result.state.opt_state)
    assert [r["step"] for r in _records(workdir)] == [0, 1, 2, 3, 4]


def test_interrupt_during_a_checkpoint_write_lets_it_finish(full_run, tmp_path):
    """Ctrl-C while Orbax's threads write step 2's periodic checkpoint: the write completes,
    the interrupt follows it and the step is not saved again (before, the KeyboardInterrupt left
    those threads writing and the handler saved step 2 a second time: StepAlreadyExistsError
    here, an OSError on the half-written folder in the CLI, exit code 1 instead of 130; found
    by launch/fault_campaign.py); the resumed run equals the uninterrupted one bitwise."""
    import signal
    result, _ = full_run
    workdir = str(tmp_path / "run")
    logged = []
    run = Run(tiny_config("train.steps=4"), workdir, log=logged.append)
    checkpointer = run.trainer.checkpointer
    manager = checkpointer._manager
    start_save, calls = manager.save, [0]

    def interrupted_save(*args, **kwargs):
        started = start_save(*args, **kwargs)   # the background writes are running now
        calls[0] += 1
        if calls[0] == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return started
    manager.save = interrupted_save
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert checkpointer.all_steps() == [2] and calls[0] == 1
    assert "interrupted: step 2 is saved; stopping" in [line.strip() for line in logged]
    run.close()
    resumed = Run(tiny_config("train.steps=4"), workdir, resume=True, log=_quiet)
    final = resumed.run()
    resumed.close()
    assert resumed.resumed_from == 2
    assert _equal_trees(final.state.params, result.state.params)
    assert _equal_trees(final.state.opt_state, result.state.opt_state)
    assert [r["step"] for r in _records(workdir)] == [0, 1, 2, 3, 4]


def test_interrupt_after_a_periodic_checkpoint_does_not_save_it_again(full_run, tmp_path):
    """Ctrl-C inside step 3, after step 2's periodic checkpoint: step 2 is the last finished
    step and is already on disk, so the run stops without saving it again (before, the second
    save raised Orbax's StepAlreadyExistsError: exit code 1 instead of 130)."""
    result, _ = full_run
    workdir = str(tmp_path / "run")
    logged = []
    run = Run(tiny_config("train.steps=4", "checkpoint.every=2"), workdir, log=logged.append)
    _interrupt_on_call(run.trainer, "train_on", 3)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert run.trainer.checkpointer.all_steps() == [2]
    assert "interrupted: step 2 is saved; stopping" in [line.strip() for line in logged]
    run.close()
    resumed = Run(tiny_config("train.steps=4"), workdir, resume=True, log=_quiet)
    final = resumed.run()
    resumed.close()
    assert _equal_trees(final.state.params, result.state.params)


def test_a_non_finite_step_stops_the_run_naming_the_metric(tmp_path):
    """A step whose metrics hold a non-finite value (here train/loss = nan from step 2's train
    call) stops the run with NonFiniteError naming the metric and the step."""
    from jrl.pipeline.loop.runner import NonFiniteError
    run = Run(tiny_config("train.steps=3", "train.sft_steps=0", "eval.greedy=false"),
              str(tmp_path), log=_quiet)
    original, calls = run.trainer.train_on, [0]

    def poisoned(batch, rl_step):
        metrics = original(batch, rl_step)
        calls[0] += 1
        if calls[0] == 2:
            metrics["train/loss"] = float("nan")
        return metrics
    run.trainer.train_on = poisoned
    with pytest.raises(NonFiniteError, match=r"step 2: non-finite values \(train/loss=nan\)"):
        run.run()
    run.close()
    assert [r["step"] for r in _records(str(tmp_path))] == [1]


def test_resume_of_a_finished_run_has_nothing_to_do_and_changes_are_named(full_run, tmp_path):
    workdir = str(tmp_path / "done")
    Run(tiny_config("train.steps=2"), workdir, log=_quiet).run()
    logged = []
    again = Run(tiny_config("train.steps=2", "algorithm.recipe=grpo"), workdir, resume=True,
                log=logged.append)
    result = again.run()
    assert int(result.state.version) == 2
    assert any("already at step 2 of 2: nothing to do" in line for line in logged)
    assert any("algorithm.recipe: 'dapo' -> 'grpo'" in line for line in logged)
    with pytest.raises(ValueError, match=r"model differs.*hidden_size: 32 -> 64"):
        Run(tiny_config("train.steps=3", "model.arch.hidden_size=64"), workdir, resume=True,
            log=_quiet)


def _corrupt(step_dir, what):
    if what == "meta":
        (step_dir / "meta" / "metadata").write_text("{broken json")
    else:   # truncate the largest array data file
        files = [p for p in step_dir.joinpath("state").rglob("*") if p.is_file()]
        biggest = max(files, key=lambda p: p.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 3])


@pytest.mark.parametrize("what", ["meta", "arrays"])
def test_resume_falls_back_past_a_corrupt_latest_checkpoint(full_run, tmp_path, what):
    """The latest checkpoint (step 4) is corrupt: resume warns, sets it aside, restores step 2,
    and training steps 3-4 again ends bitwise equal to the uninterrupted run."""
    import pathlib
    import shutil
    result, source = full_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    _corrupt(workdir / "checkpoints" / "4", what)
    logged = []
    run = Run(tiny_config("train.steps=4"), str(workdir), resume=True, log=logged.append)
    assert run.resumed_from == 2
    warning = [line for line in logged if line.startswith("warning: resume: checkpoint step 4")]
    assert warning and "unreadable" in warning[0] and "4.corrupt-0" in warning[0]
    final = run.run()
    run.close()
    assert _equal_trees(final.state.params, result.state.params)
    names = sorted(p.name for p in pathlib.Path(workdir, "checkpoints").iterdir())
    assert "4.corrupt-0" in names and "4" in names          # the new step 4 was written


def test_resume_step_picks_a_checkpoint_and_names_the_available_ones(full_run, tmp_path):
    import shutil
    result, source = full_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    with pytest.raises(ValueError, match=r"--resume-step 3: no such checkpoint.*\[2, 4\]"):
        Run(tiny_config("train.steps=4"), str(workdir), resume_step=3, log=_quiet)
    run = Run(tiny_config("train.steps=4"), str(workdir), resume_step=2, log=_quiet)
    assert run.resumed_from == 2 and run.start_step == 2
    run.close()


def test_a_synchronous_run_recomputes_p_o_on_sampled_steps_only(tmp_path):
    """train.p_o_every=2: on the exact path a synchronous step's p_o is p_b by construction, so
    only RL steps 1 and 3 (rl_step 0 and 2) score the tokens with the train engine and report
    mismatch/*; the trained params are the every-step run's bit for bit, and the train engine
    ran half as many scoring passes (4 steps: 2 against 4; the KL reference adds one per step to
    each)."""
    runs = {}
    for every in (1, 2):
        run = Run(tiny_config("train.steps=4", f"train.p_o_every={every}", "checkpoint.every=0",
                              "eval.greedy=false", "train.reference=loss",
                              "algorithm.kl_beta=0.04"),
                  str(tmp_path / f"every{every}"), log=_quiet)
        calls = []
        score_with = run.trainer.score_with

        def counted(packed, score_with=score_with, calls=calls):
            score = score_with(packed)
            return lambda params: (calls.append(1), score(params))[1]

        run.trainer.score_with = counted
        runs[every] = (run.run(), run.history, len(calls))
        run.close()
    (dense, dense_history, dense_calls), (sampled, history, calls) = runs[1], runs[2]
    assert _equal_trees(dense.state.params, sampled.state.params)
    measured = [r["step"] for r in history if "mismatch/logprob_abs_diff_max" in r]
    assert measured == [1, 3]
    assert all(r["mismatch/logprob_abs_diff_max"] == 0.0 for r in dense_history)
    # 4 p_o passes + 4 reference passes against 2 + 4.
    assert (dense_calls, calls) == (8, 6)
    for a, b in zip(dense_history, history):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
