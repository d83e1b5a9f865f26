"""Every numeric config field is range-checked when the RunConfig is built: one ValueError line
naming the field and what is allowed (in process: the CLI's own table is tests/launch)."""

import re

import pytest

from jrl.checks import check_int, check_range, check_seed
from jrl.models.config import ModelConfig
from jrl.pipeline.setup.model import check_model_fits
from jrl.pipeline.config.tools import apply_overrides
from tests.pipeline.tiny import tiny_config

BAD_VALUES = [
    ("optimizer.b1=2", "optimizer.b1=2.0: must be a number in [0, 1)"),
    ("optimizer.b1=1", "optimizer.b1=1.0: must be a number in [0, 1)"),
    ("optimizer.b2=-1", "optimizer.b2=-1.0: must be a number in [0, 1)"),
    ("optimizer.eps=-1", "optimizer.eps=-1.0: must be a finite number > 0"),
    ("optimizer.eps=0", "optimizer.eps=0.0: must be a finite number > 0"),
    ("optimizer.weight_decay=-5", "optimizer.weight_decay=-5.0: must be a finite number >= 0"),
    ("optimizer.end_lr_fraction=-3", "optimizer.end_lr_fraction=-3.0: must be a number in "
                                     "[0, 1]"),
    ("optimizer.learning_rate=nan", "optimizer.learning_rate=nan: must be > 0"),
    ("sampling.temperature=inf", "temperature=inf: must be a finite number > 0"),
    ("sampling.temperature=0", "temperature=0.0: must be a finite number > 0"),
    ("algorithm.entropy_coef=-10", "algorithm.entropy_coef=-10.0: must be a finite number >= 0"),
    ("algorithm.eps_low=-0.5", "algorithm.eps_low=-0.5: must be a number in [0, 1]"),
    ("algorithm.eps_high=-1", "algorithm.eps_high=-1.0: must be a finite number >= 0"),
    ("algorithm.std_power=-1", "algorithm.std_power=-1.0: must be a finite number >= 0"),
    ("algorithm.tis_cap=0", "algorithm.tis_cap=0.0: must be a finite number > 0"),
    ("algorithm.kl_beta=nan", "algorithm.kl_beta=nan: must be a finite number >= 0"),
    ("train.sft_learning_rate=-1", "train.sft_learning_rate=-1.0: must be a finite number >= 0"),
    ("train.kl_reward_coef=-1", "train.kl_reward_coef=-1.0: must be a finite number >= 0"),
    ("algorithm.overlong_factor=-1", "algorithm.overlong_factor=-1.0: must be a finite number >= 0"),
    ("rollout.format_reward=nan", "rollout.format_reward=nan: must be a finite number"),
    ("rollout.format_reward=inf", "rollout.format_reward=inf: must be a finite number"),
    ("rollout.speculative.num_draft=-1", "rollout.speculative.num_draft=-1: must be >= 0"),
    # inf passed "> 0" (the probe: the run died at step 1 after 79 s).
    ("algorithm.load_balance_coef=inf", "algorithm.load_balance_coef=inf: must be a finite number >= 0"),
    # k drafts must leave room in a response (the probe: k = 100000 died out of memory).
    ("rollout.speculative.num_draft=8",
     "rollout.speculative.num_draft=8: must be below sampling.max_new_tokens=8"),
    ("rollout.speculative.num_draft=100000",
     "rollout.speculative.num_draft=100000: must be below sampling.max_new_tokens=8"),
    ("rollout.speculative.ngram_max=0", "rollout.speculative.ngram_max=0: must be > 0"),
    ("rollout.speculative.draft_min_accept=2",
     "rollout.speculative.draft_min_accept=2.0: must be a number in [0, 1]"),
    ("rollout.speculative.draft=draft", "rollout.speculative.draft='draft' needs "
                                        "rollout.speculative.num_draft=k > 0"),
    ("rollout.speculative.draft_pick=best", "rollout.speculative.draft_pick='best': allowed "
                                            "values are ['draw', 'argmax', 'target_key']"),
    ("rollout.speculative.draft_pick=argmax", "rollout.speculative.draft_pick='argmax' needs "
                                              "rollout.speculative.draft"),
    ("rollout.prefill_buckets=all", "rollout.prefill_buckets='all': allowed values are "
                                    "['powers_of_two', 'one']"),
    ("pipeline.drop_stale_beyond=-1", "pipeline.drop_stale_beyond=-1: must be an int >= 0"),
    ("data.num_terms=0", "data.num_terms=0: must be an int >= 1"),
    ("data.max_operand=-1", "data.max_operand=-1: must be an int >= 0"),
    ("data.too_long=truncate", "data.too_long='truncate': allowed values are ['error', 'skip']"),
    ("data.seed=-1", "data.seed=-1: must be an int in [0, 2**32)"),
    # tiny_config's template is plain: template variables are for chat templates only.
    ("data.chat_template_kwargs=enable_thinking=false",
     "data.chat_template_kwargs='enable_thinking=false': only used with data.template='chat'"),
    # A user's own reward and record file: the form is checked at load, the import at setup.
    ("rollout.reward_fn=my_reward", "rollout.reward_fn='my_reward': must be "
                                    "'package.module:function' or 'path/to/file.py:function'"),
    ("rollout.reward_weights=correct=1", "rollout.reward_weights='correct=1' weighs the named "
                                         "parts of rollout.reward_fn, which is not set"),
    ("data.prompt_field=problem", "data.prompt_field='problem' reads a record file: only used "
                                  "with data.source='file', not 'arithmetic'"),
    ("data.answer_format=latex", "data.answer_format='latex': allowed values are ['text', "
                                 "'gsm8k']"),
    ("data.source=file", "data.path is required with data.source='file' (a local .jsonl or "
                         ".parquet file)"),
    ("model.init_seed=4294967296", "model.init_seed=4294967296: must be an int in [0, 2**32)"),
    ("seed=99999999999999999999", "seed=99999999999999999999: must be an int in [0, 2**32)"),
    ("sampling.group_size=1", "sampling.group_size=1 with algorithm.recipe='dapo': needs group_size "
                              ">= 2: with groups of one sample every group-normalised advantage "
                              "is 0"),
]


@pytest.mark.parametrize("override, message", BAD_VALUES)
def test_a_bad_value_is_refused_naming_the_field(override, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        apply_overrides(tiny_config(), [override])
    assert "\n" not in str(caught.value)


def test_chat_template_kwargs_parse_and_round_trip():
    from jrl.pipeline.config import RunConfig
    from jrl.pipeline.config.tools import from_dict, to_dict
    config = apply_overrides(tiny_config(), [
        "data.template=chat", "data.chat_template_kwargs=enable_thinking=false, depth=2, tag=x"])
    assert config.data.template_variables() == (("enable_thinking", False), ("depth", 2),
                                                ("tag", "x"))
    assert from_dict(RunConfig, to_dict(config)) == config          # config.json round trip
    with pytest.raises(ValueError, match=re.escape(
            "data.chat_template_kwargs='enable_thinking': 'enable_thinking' is not name=value")):
        apply_overrides(tiny_config(), ["data.template=chat",
                                        "data.chat_template_kwargs=enable_thinking"])


def test_group_size_one_with_unbiased_std_names_both_fields():
    with pytest.raises(ValueError, match=r"sampling\.group_size=1 with algorithm\.recipe='dapo' and "
                                         r"algorithm\.unbiased_std=True: .*undefined"):
        apply_overrides(tiny_config(), ["sampling.group_size=1", "algorithm.unbiased_std=true"])


@pytest.mark.parametrize("override", ["optimizer.b1=0", "optimizer.end_lr_fraction=1",
                                      "optimizer.weight_decay=0", "algorithm.eps_low=0",
                                      "pipeline.drop_stale_beyond=0", "data.max_operand=0",
                                      "seed=4294967295", "train.sft_learning_rate=0",
                                      "rollout.format_reward=-0.5"])
def test_the_bounds_themselves_are_allowed(override):
    apply_overrides(tiny_config(), [override])


def test_check_helpers_refuse_non_numbers_and_bools():
    with pytest.raises(ValueError, match=r"x='1': must be a finite number"):
        check_range("x", "1")
    with pytest.raises(ValueError, match=r"n=True: must be an int >= 0"):
        check_int("n", True, low=0)
    with pytest.raises(ValueError, match=r"s=1.5: must be an int in \[0, 2\*\*32\)"):
        check_seed("s", 1.5)
    with pytest.raises(ValueError, match=r"y=-inf: must be a finite number <= 3"):
        check_range("y", float("-inf"), high=3)


def test_stop_tokens_must_be_in_the_model_vocabulary():
    config = apply_overrides(tiny_config(), ["sampling.stop_tokens=(5, 999999)"])
    model = ModelConfig(vocab_size=64)
    with pytest.raises(ValueError, match=re.escape(
            "sampling.stop_tokens=[5, 999999]: [999999] outside the model's vocabulary [0, 64)")):
        check_model_fits(config, model)
    check_model_fits(apply_overrides(tiny_config(), ["sampling.stop_tokens=(5, 63)"]), model)


def test_the_position_budget_must_fit_the_model():
    # tiny_config: max_prompt_len 24 + max_new_tokens 8 = 32 positions.
    config = tiny_config()
    check_model_fits(config, ModelConfig(vocab_size=64, max_position_embeddings=32))
    with pytest.raises(ValueError, match=re.escape(
            "rollout.max_prompt_len + sampling.max_new_tokens = 24 + 8 = 32 positions, more than "
            "the model's max_position_embeddings=31")):
        check_model_fits(config, ModelConfig(vocab_size=64, max_position_embeddings=31))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.reward_fn=m:f", "rollout.reward_mode=boxed"],
     "rollout.reward_mode='boxed' configures the built-in verifier, which "
     "rollout.reward_fn='m:f' replaces: leave it unset"),
    (["rollout.reward_fn=m:f", "rollout.reward_weights=a=x"],
     "rollout.reward_weights='a=x': 'a=x' is not name=weight"),
    (["data.source=file", "data.path=p.csv"],
     "data.path='p.csv': data.source='file' reads .jsonl or .parquet files"),
    (["data.source=file", "data.path=p.jsonl", "data.prompt_field=x", "data.record_adapter=m:f"],
     "data.prompt_field and data.record_adapter both say how a record is read: give one"),
    (["data.source=file", "data.path=p.jsonl", "data.record_adapter=adapter"],
     "data.record_adapter='adapter': must be 'package.module:function'"),
    (["data.source=file", "data.path=p.jsonl", "data.answer_field="],
     "data.answer_field is empty: name the record field"),
    (["sampling.max_new_tokens=24", "env.name=calculator", "rollout.reward_fn=m:f"],
     "rollout.reward_fn='m:f' is not used with env.name='calculator'"),
])
def test_a_custom_task_option_that_cannot_work_is_refused_at_load(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        apply_overrides(tiny_config(), overrides)
    assert "\n" not in str(caught.value)


def test_the_user_task_options_round_trip_through_config_json():
    from jrl.pipeline.config import RunConfig
    from jrl.pipeline.config.tools import from_dict, to_dict
    config = apply_overrides(tiny_config(), [
        "data.source=file", "data.path=mine.parquet", "data.prompt_field=problem",
        "data.answer_field=target", "data.solution_field=worked", "data.answer_format=gsm8k",
        "rollout.reward_fn=my_pkg.rewards:score", "rollout.reward_weights=correct=1,len=0.1"])
    assert from_dict(RunConfig, to_dict(config)) == config
    assert config.data.record_fields().prompt == "problem"


def test_a_reward_module_that_cannot_be_loaded_is_a_setup_error_naming_the_key(tmp_path):
    from jrl.pipeline.loop.runner import Run
    config = apply_overrides(tiny_config(), ["rollout.reward_fn=no_such_pkg.rewards:score"])
    with pytest.raises(ValueError, match=re.escape(
            "rollout.reward_fn='no_such_pkg.rewards:score': no module named 'no_such_pkg'")):
        Run(config, str(tmp_path / "run"), log=lambda *_: None)
    source = tmp_path / "one_arg.py"
    source.write_text("def score(response):\n    return 0.0\n")
    config = apply_overrides(tiny_config(), [f"rollout.reward_fn={source}:score"])
    with pytest.raises(ValueError, match=r"score\(response\) cannot be called as "
                                         r"fn\(response, example"):
        Run(config, str(tmp_path / "run2"), log=lambda *_: None)


@pytest.mark.parametrize("override, message", [
    ("algorithm.recipe=dapoo", "algorithm.recipe='dapoo': allowed values are ['cispo', 'dapo', 'dr_grpo', "
                          "'grpo', 'gspo']; did you mean 'dapo'?"),
    ("train.step=3", "unknown config key 'train.step': 'step' is not a field of train; did you "
                     "mean 'steps'?"),
    ("numerics.backend=palas", "NumericalContract.backend='palas': allowed values are ['pallas', "
                               "'xla']; did you mean 'pallas'?"),
    ("optimizer.schedule=cosin", "did you mean 'cosine'?"),
    ("metrics.wandb_mode=ofline", "metrics.wandb_mode='ofline': allowed values are ['online', "
                                  "'offline']; did you mean 'offline'?"),
    ("metrics.backends=[jsonl,tensorbord]", "metrics.backends: unknown backend 'tensorbord'; "
                                            "allowed: ['jsonl', 'tensorboard', 'wandb']; did "
                                            "you mean 'tensorboard'?"),
])
def test_a_likely_typo_gets_the_closest_allowed_name(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_overrides(tiny_config(), [override])


def test_a_value_far_from_every_allowed_one_gets_no_guess():
    with pytest.raises(ValueError) as caught:
        apply_overrides(tiny_config(), ["algorithm.recipe=zzzzzz"])
    assert "did you mean" not in str(caught.value)
