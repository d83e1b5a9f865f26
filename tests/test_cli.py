"""The `jrl` command: subcommands dispatch to their modules, shipped configs are found by name,
and a wrong command or config name gets one line naming what is allowed."""

import signal

import pytest

from jrl import cli, configs
from jrl.cli import train


def test_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert f"jrl {command}" in out


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: jrl COMMAND" in capsys.readouterr().out


def test_an_unknown_command_names_the_allowed_ones(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err and "device-check" in err


def test_configs_lists_the_shipped_configs(capsys):
    assert cli.main(["configs"]) == 0
    listed = capsys.readouterr().out.split()
    assert "arith_tiny" in listed and "gsm8k_qwen3_sync" in listed
    assert listed == configs.names()


def test_a_shipped_config_is_found_by_name_and_a_path_still_works():
    by_name = train.load_config("arith_tiny", ["train.steps=3"])
    by_path = train.load_config(configs.path("arith_tiny.py"), ["train.steps=3"])
    assert by_name == by_path and by_name.train.steps == 3
    assert configs.path("no_such_config") is None


def test_an_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match=r"'arith_tiyn'.*arith_tiny"):
        train.load_config("arith_tiyn", [])


def test_train_help_runs_through_the_dispatcher(capsys):
    # `jrl train` installs the stop handler; the test worker gets its own handlers back.
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["train", "--help"])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert exit_info.value.code == 0
    assert "usage: jrl train" in capsys.readouterr().out


def test_device_check_outside_a_checkout_says_where_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["device-check"]) == 2
    assert "repository checkout" in capsys.readouterr().err


def test_print_config_shows_the_overrides_and_the_platform_contract(capsys):
    import json
    assert train.main(["--config", "arith_tiny", "--set", "train.steps=5", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["steps"] == 5
    # The contract a run records: resolved for this platform, its tiles named.
    assert printed["numerics"]["platform"] == "cpu"
    assert printed["numerics"]["attn_block_q"] == 4          # for_platform("cpu")'s query tile


def test_help_config_prints_a_section_and_a_typo_gets_the_closest_name(capsys):
    assert train.main(["--help-config", "rollout"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout: RolloutSection")
    assert "reward_fn: your own reward instead" in out                 # the section's prose
    assert "  rollout.reward_weights (str) = ''" in out                 # each field, defaults
    assert train.main(["--help-config", "train", "--config", "arith_tiny",
                       "--set", "train.steps=7"]) == 0
    assert "  train.steps (int) = 7" in capsys.readouterr().out        # the config's values
    assert train.main(["--help-config", "rolout"]) == 2
    assert "did you mean 'rollout'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main([])                               # neither --config nor --help-config
    assert "--config is required" in capsys.readouterr().err
