"""Whole RL runs with the faster rollouts on (rollout.share_prefill, rollout.speculative): the
sampler's p_b still equals the trainer's p_o exactly at every step, synchronously and with
weight swaps landing inside samples."""

import jax
import pytest

from jrl.models import load_hf_mtp, transformer
from jrl.models.hf_checkpoint import save_hf
from jrl.pipeline.loop.runner import Run
from jrl.sampling import SpeculativeConfig
from jrl.cli.convert import export_hf, source_mtp_head
from tests.pipeline.swaps import run_with_a_swap_inside_a_sample
from tests.pipeline.tiny import tiny_config

FAST = ("rollout.share_prefill=true", "rollout.speculative.num_draft=3", "eval.greedy=false",
        "checkpoint.every=0")


def _quiet(*_):
    pass


def _spec_totals(run):
    return {key: sum(s.last_stats.get(key, 0) for s in run.worker.samplers)
            for key in ("spec_drafted", "spec_accepted", "prefill_rows", "prefix_hits")}


def test_config_builds_samplers_with_shared_prefill_and_speculation(tmp_path):
    with Run(tiny_config(*FAST, "rollout.speculative.ngram_max=2"), str(tmp_path / "fast"),
             log=_quiet) as run:
        sampler = run.worker.samplers[0]
        assert sampler.share_prefill
        assert sampler.speculative == SpeculativeConfig(num_draft=3, ngram_max=2)
    with Run(tiny_config("eval.greedy=false"), str(tmp_path / "plain"), log=_quiet) as plain:
        assert not plain.worker.samplers[0].share_prefill
        assert plain.worker.samplers[0].speculative is None


def test_bitwise_speculative_shared_prefill_run_has_zero_mismatch_every_step(tmp_path):
    # A longer response budget than tiny_config's 8 tokens gives the n-gram drafts a history.
    run = Run(tiny_config(*FAST, "train.steps=3", "sampling.max_new_tokens=16"),
              str(tmp_path), log=_quiet)
    run.run()
    assert len(run.history) == 3
    for record in run.history:
        assert record["mismatch/logprob_abs_diff_max"] == 0.0
        assert record["mismatch/numerical_abs"] == 0.0
        assert 0.0 <= record["rollout/spec_accept_rate"] <= 1.0
        assert record["rollout/spec_tokens_per_step"] >= 1.0
    totals = _spec_totals(run)
    # Not vacuous: drafts were made and verified, and the sampler (one serve for the whole run)
    # ran each prompt through the model once: 3 steps x 4 prompts = 12 prompt rows for the
    # 3 x 4 x 4 = 48 samples, the other 48 - 12 = 36 seated from the pool.
    assert totals["spec_drafted"] > 0
    assert totals["prefill_rows"] == 12 and totals["prefix_hits"] == 36


def test_bitwise_speculative_draft_model_run_has_zero_mismatch_every_step(tmp_path):
    # A draft half the policy's width, saved as a Hugging Face checkpoint (what a user points
    # rollout.speculative.draft at); its drawn drafts are accepted by rejection sampling.
    policy = tiny_config().model.arch
    draft = policy.replace(hidden_size=16, num_heads=1, head_dim=16, intermediate_size=32)
    save_hf(tmp_path / "draft", draft, transformer.init_params(draft, jax.random.key(1)),
            dtype="float32")
    config = tiny_config("rollout.speculative.num_draft=3", f"rollout.speculative.draft={tmp_path}/draft",
                         "eval.greedy=false", "checkpoint.every=0", "train.steps=2",
                         "sampling.max_new_tokens=16")
    run = Run(config, str(tmp_path / "run"), log=_quiet)
    assert run.worker.samplers[0].draft_model.config == draft
    assert run.worker.samplers[0].speculative.draft == "draft_model"
    run.run()
    assert len(run.history) == 2
    for record in run.history:
        assert record["mismatch/logprob_abs_diff_max"] == 0.0
        assert record["mismatch/numerical_abs"] == 0.0
        assert 0.0 < record["rollout/spec_accept_rate"] <= 1.0
        assert record["rollout/spec_tokens_per_step"] > 1.0
    assert _spec_totals(run)["spec_drafted"] > 0


def test_a_missing_draft_checkpoint_is_refused_naming_the_field(tmp_path):
    config = tiny_config("rollout.speculative.num_draft=3",
                         f"rollout.speculative.draft={tmp_path}/no_such_draft")
    with pytest.raises(FileNotFoundError, match="rollout.speculative.draft=.*no_such_draft"):
        Run(config, str(tmp_path / "run"), log=_quiet)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 host devices (tests/conftest.py)")
def test_bitwise_speculative_async_run_with_a_weight_swap_inside_a_sample(tmp_path):
    # The helper checks that the swap landed inside a step-1 sample, that the samplers
    # recomputed their caches and that every token was reproduced exactly.
    run, rollouts = run_with_a_swap_inside_a_sample(str(tmp_path), *FAST, "train.steps=3")
    assert run.worker.samplers[0].speculative is not None
    assert all(s.spec is not None for s in rollouts[1].samples)   # speculation ran for them


class _NoTokenizerFiles:
    """export_hf's tokenizer for a run on the character tokenizer (which has no HF files)."""

    pad_id = 0

    def hf_files(self, model_max_length):
        return {}


def test_bitwise_speculative_mtp_run_has_zero_mismatch_every_step(tmp_path):
    # The policy as a Hugging Face checkpoint that carries an MTP head (random here, its
    # weights scaled up so that its drafts are peaked); rollout.speculative.draft=mtp drafts
    # with it (drawn drafts, rejection sampling: p_b is still the trainer's p_o).
    from jrl.models import mtp

    policy = tiny_config().model.arch
    head = jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x,
                        mtp.init_params(policy, jax.random.key(2)))
    save_hf(tmp_path / "policy", policy, transformer.init_params(policy, jax.random.key(0)),
            dtype="float32", mtp_head=head)
    config = tiny_config("model.source=hf", f"model.path={tmp_path}/policy",
                         "rollout.speculative.num_draft=3", "rollout.speculative.draft=mtp",
                         "rollout.speculative.draft_min_accept=0", "eval.greedy=false",
                         "checkpoint.every=0", "train.steps=2", "sampling.max_new_tokens=16")
    run = Run(config, str(tmp_path / "run"), log=_quiet)
    sampler = run.worker.samplers[0]
    assert sampler.speculative.draft == "mtp" and sampler.mtp_head is not None
    # --export-hf keeps the head the policy was loaded with (the run does not train it).
    export_hf(str(tmp_path / "export"), run.trainer.model_config,
              transformer.init_params(policy, jax.random.key(3)), _NoTokenizerFiles(),
              mtp_head=source_mtp_head(config.model))
    exported = load_hf_mtp(tmp_path / "export", dtype="float32")[1]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), exported, head))
    assert source_mtp_head(tiny_config().model) is None
    run.run()
    assert len(run.history) == 2
    for record in run.history:
        assert record["mismatch/logprob_abs_diff_max"] == 0.0
        assert record["mismatch/numerical_abs"] == 0.0
        assert 0.0 <= record["rollout/spec_accept_rate"] <= 1.0
    assert _spec_totals(run)["spec_drafted"] > 0


def test_mtp_drafts_need_the_policy_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.speculative.draft='mtp' drafts with the "
                                         r"policy checkpoint's MTP head: it needs "
                                         r"model.source='hf' \(got 'random'\)"):
        tiny_config("rollout.speculative.num_draft=3", "rollout.speculative.draft=mtp")
    policy = tiny_config().model.arch
    save_hf(tmp_path / "plain", policy, transformer.init_params(policy, jax.random.key(0)),
            dtype="float32")
    config = tiny_config("model.source=hf", f"model.path={tmp_path}/plain",
                         "rollout.speculative.num_draft=3", "rollout.speculative.draft=mtp")
    with pytest.raises(ValueError, match=r"plain: no multi-token-prediction head"):
        Run(config, str(tmp_path / "run"), log=_quiet)


def test_self_speculative_run_trains_exactly_as_plain_decoding(tmp_path):
    """rollout.speculative.draft=fast_path: the policy drafts itself on the plain-XLA kernels
    and the exact path verifies, so a run's samples, and with them every metric that is not a
    timing or a count of decode work, are plain decoding's bit for bit."""
    common = ("eval.greedy=false", "checkpoint.every=0", "train.steps=2",
              "sampling.max_new_tokens=16")
    fast = Run(tiny_config(*common, "rollout.speculative.num_draft=3",
                           "rollout.speculative.draft=fast_path"),
               str(tmp_path / "fast"), log=_quiet)
    sampler = fast.worker.samplers[0]
    assert sampler.speculative.draft == "fast_path"
    assert sampler.speculative.draft_pick == "target_key" and sampler.draft_model is None
    fast.run()
    plain = Run(tiny_config(*common), str(tmp_path / "plain"), log=_quiet)
    plain.run()
    work = ("time/", "rollout/spec", "rollout/decode", "rollout/prefill", "rollout/idle")
    compared = 0
    for a, b in zip(fast.history, plain.history):
        for key in sorted(set(a) & set(b)):
            if not key.startswith(work):
                assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key
                compared += 1
        assert a["mismatch/logprob_abs_diff_max"] == 0.0
        assert a["rollout/spec_accept_rate"] >= 0.8
    assert compared >= 20 and _spec_totals(fast)["spec_drafted"] > 0
    fast.close()
    plain.close()
