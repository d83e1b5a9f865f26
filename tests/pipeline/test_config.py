"""Config loading and validation: bad keys and values are rejected at start, naming the key."""

import dataclasses

import pytest

from jrl.pipeline.config.tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.config import RunConfig
from jrl.cli import train as train_cli
from tests.pipeline.tiny import tiny_config

CONFIGS = ["arith_tiny", "arith_tiny_async", "smollm2_arith", "gsm8k_qwen3_sync",
           "gsm8k_qwen3_async", "calc_tiny", "smollm2_calc"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_loads_and_round_trips(name):
    config = train_cli.load_config(f"jrl/configs/{name}.py", [])
    assert from_dict(RunConfig, to_dict(config)) == config


def test_overrides_are_typed():
    config = apply_overrides(tiny_config(), ["train.steps=7", "algorithm.tis_cap=2.5",
                                              "train.old_logp=recompute",
                                              "sampling.stop_tokens=(5, 6)",
                                              "pipeline.drop_stale_beyond=none",
                                              "eval.sampled=true"])
    assert config.train.steps == 7 and config.algorithm.tis_cap == 2.5
    assert config.sampling.stop_tokens == (5, 6) and config.pipeline.drop_stale_beyond is None
    assert config.eval.sampled is True


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown config key 'train.stepz'"),
    ("nosuch.key=1", "unknown config key 'nosuch.key'"),
    ("train.steps=many", "train.steps='many': expected an integer"),
    ("algorithm.recipe=ppo", "algorithm.recipe='ppo': allowed values are"),
    ("numerics.backend=cuda", "NumericalContract.backend='cuda': allowed values are"),
    ("sampling.top_p=1.5", "SamplingParams.top_p=1.5"),
    ("train.micro_batches=3", "train.micro_batches=3"),
    ("pipeline.kv_on_swap=drop", "pipeline.kv_on_swap='drop'"),
    ("train.steps", "expected key=value"),
    ("env.name=abacus", "env.name='abacus': allowed values are ['none', 'calculator', 'python'], "
                        "'package.module:factory' or 'path/to/file.py:factory'"),
    ("env.max_turns=0", "env.max_turns=0"),
    ("env.name=calculator", "env.max_observation_tokens=16 leaves no room in "
                            "sampling.max_new_tokens=8"),
    ("env.observation_format={obs}", "only field is {observation}"),
    ("train.sft_tool_frac=0.5", "train.sft_tool_frac=0.5 needs a tool environment"),
    ("train.sft_tool_frac=2", "train.sft_tool_frac=2.0: must be a number in [0, 1]"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace(".", r"\.")):
        apply_overrides(tiny_config(), [override])


@pytest.mark.parametrize("name, message", [
    ("nosuch_module:Env", "env.name='nosuch_module:Env': no module named 'nosuch_module'"),
    ("jrl.envs:NoSuchEnv", "env.name='jrl.envs:NoSuchEnv': 'jrl.envs' has no attribute "
                           "'NoSuchEnv' (it has: "),
    ("jrl.envs:ENVIRONMENTS", "is a tuple, not a callable"),
])
def test_a_custom_environment_that_cannot_be_made_is_a_setup_error(name, message):
    config = apply_overrides(tiny_config(), ["sampling.max_new_tokens=24", f"env.name={name}"])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config.env.environment_factory(config.rollout.reward_mode)


def test_a_multi_turn_run_refuses_a_format_reward_and_a_reward_fn(tmp_path):
    from jrl.pipeline.loop.runner import Run
    with pytest.raises(ValueError, match="rollout.format_reward=0.1 is not used"):
        apply_overrides(tiny_config(), ["sampling.max_new_tokens=24", "env.name=calculator",
                                        "rollout.format_reward=0.1"])
    with pytest.raises(ValueError, match="a reward_fn would not be used"):
        Run(apply_overrides(tiny_config(), ["sampling.max_new_tokens=24", "env.name=calculator"]),
            str(tmp_path),
            reward_fn=lambda text, example: 1.0, log=lambda *_: None)


def test_cli_rejects_bad_config_with_exit_code_2(capsys, tmp_path):
    code = train_cli.main(["--config", "jrl/configs/arith_tiny.py", "--set", "train.stepz=1",
                           "--workdir", str(tmp_path)])
    assert code == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err


@pytest.mark.parametrize("corrections", [["algorithm.tis_cap=2.0"],
                                         ["algorithm.mis_threshold=2.0"]])
def test_tis_or_mis_with_p_old_equal_to_p_b_is_refused(corrections):
    # With train.old_logp="behavior" the correction weight p_old / p_b is exactly 1: a no-op.
    with pytest.raises(ValueError, match=r"need train.old_logp='recompute'.*exactly 1"):
        apply_overrides(tiny_config(), corrections + ["train.old_logp=behavior"])
    # Unset, train.old_logp follows the recipe's need for p_b apart from p_old.
    config = apply_overrides(tiny_config(), corrections)
    assert config.train.old_logp == "auto" and config.recipe().needs_behavior_logp
    assert config.resolved_train().old_logp == "recompute"
    assert config.resolved().train.old_logp == "recompute"
    assert tiny_config().resolved_train().old_logp == "behavior"


def test_train_reference_follows_the_recipes_kl_term_unless_set():
    kl = apply_overrides(tiny_config(), ["algorithm.kl_beta=0.04"])
    assert kl.train.reference == "auto" and kl.recipe().needs_reference
    assert kl.resolved_train().reference == "loss"
    # An override of the algorithm moves the followed value along (it stays "auto").
    assert apply_overrides(kl, ["algorithm.kl_beta=0"]).resolved_train().reference == "none"
    assert apply_overrides(kl, ["train.reference=reward", "algorithm.kl_beta=0"]) \
        .resolved_train().reference == "reward"
    with pytest.raises(ValueError, match=r"algorithm\.kl_beta=0\.04 \(a KL term\) needs "
                                         r"train\.reference='loss'.*not 'none'"):
        apply_overrides(kl, ["train.reference=none"])
    with pytest.raises(ValueError, match=r"train\.reference='loss' needs a KL term: set "
                                         r"algorithm\.kl_beta > 0"):
        apply_overrides(tiny_config(), ["train.reference=loss"])


def test_kl_importance_weighted_needs_a_kl_term_and_reaches_the_chain():
    with pytest.raises(ValueError, match=r"algorithm\.kl_importance_weighted=True needs a KL "
                                         r"term: set algorithm\.kl_beta > 0"):
        apply_overrides(tiny_config(), ["algorithm.recipe=grpo",
                                        "algorithm.kl_importance_weighted=true"])
    kl = ["algorithm.recipe=grpo", "algorithm.kl_beta=0.04", "algorithm.kl_importance_weighted=true"]
    with pytest.raises(ValueError, match="exclude each other"):
        apply_overrides(tiny_config(), kl + ["algorithm.kl_straight_through=true"])
    config = apply_overrides(tiny_config(), kl)
    assert config.algorithm.kl_importance_weighted is True
    assert "KLPenalty(beta=0.04, kind='k3'" in repr(config.recipe().loss)
    assert "importance_weighted=True" in repr(config.recipe().loss)


@pytest.mark.parametrize("steps", ["-2", "0", "two"])
def test_cli_rejects_a_step_count_below_one(capsys, steps):
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["--config", "jrl/configs/arith_tiny.py", "--steps", steps])
    assert exit_info.value.code == 2
    assert f"{steps!r} is not a positive integer" in capsys.readouterr().err


def test_a_workdir_holding_a_run_is_refused_with_exit_code_2(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "jrl-run.json").write_text('{"format": "jrl-run"}')
    code = train_cli.main(["--config", "jrl/configs/arith_tiny.py", "--workdir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "already holds a run (jrl-run.json, metrics.jsonl)" in err and "--overwrite" in err
    assert (tmp_path / "metrics.jsonl").exists()


def test_missing_files_give_clear_errors(capsys, tmp_path):
    assert train_cli.main(["--config", str(tmp_path / "nope.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    code = train_cli.main(["--config", "jrl/configs/gsm8k_qwen3_sync.py", "--workdir",
                           str(tmp_path)])
    assert code == 2
    assert "model.path='SET_ME': no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("filename, source, message", [
    ("broken.py", "def get_config(:\n", "(line 1): SyntaxError"),
    ("broken.py", "import no_such_module_xyz\n",
     "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("broken.py", "def get_config():\n    return {'name': 'x'}\n", "get_config() returned dict"),
    ("broken.py", "def get_config():\n    raise RuntimeError('boom')\n",
     "get_config() raised RuntimeError: boom"),
    ("config.json", '{"train": {"steps": 1', "(line 1): not readable as JSON: JSONDecodeError"),
    ("config.json", "[1, 2]", "holds a JSON list, not the object of a RunConfig"),
    ("config.json", '{"train": {"stepz": 1}}', "unknown config key 'train.stepz'"),
])
def test_a_broken_config_file_is_one_message_naming_it(capsys, tmp_path, filename, source,
                                                       message):
    path = tmp_path / filename
    path.write_text(source)
    assert train_cli.main(["--config", str(path), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err and "Traceback" not in err


TINY_CLI = '''
from tests.pipeline.tiny import tiny_config

def get_config():
    return tiny_config("train.steps=1", "train.sft_steps=0", "eval.greedy=false",
                       "checkpoint.every=0")
'''


def test_a_runs_own_config_json_is_accepted_by_config_and_runs_the_same_setup(tmp_path):
    import json
    source = tmp_path / "tiny_cli.py"
    source.write_text(TINY_CLI)
    first, again = tmp_path / "first", tmp_path / "again"
    assert train_cli.main(["--config", str(source), "--workdir", str(first)]) == 0
    saved = first / "config.json"
    # config.json records the contract resolved for this platform (Run); otherwise the same.
    resolved = train_cli.load_config(str(source), [])
    resolved = dataclasses.replace(resolved, numerics=resolved.numerics.resolved_for())
    assert train_cli.load_config(str(saved), []) == resolved
    assert train_cli.main(["--config", str(saved), "--workdir", str(again)]) == 0
    assert (again / "config.json").read_text() == saved.read_text()
    # The same run: the same rewards, loss and gradient, bit for bit (timings aside).
    records = [[json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
               for workdir in (first, again)]
    for a, b in zip(*records):
        for name in ("rollout/reward_mean", "train/loss", "train/grad_norm"):
            assert a[name] == b[name], name
    # --set still applies on top of a JSON config.
    assert train_cli.load_config(str(saved), ["train.steps=5"]).train.steps == 5

