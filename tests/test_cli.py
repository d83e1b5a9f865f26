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


def test_calibrate_tiles_needs_an_output_and_a_cpu_pallas_contract(capsys):
    assert cli.main(["calibrate-tiles", "--config", "arith_tiny"]) == 2
    assert "--out FILE is required" in capsys.readouterr().err
    assert cli.main(["calibrate-tiles", "--config", "arith_tiny", "--out", "x.json",
                     "--set", "numerics.backend=xla"]) == 2
    assert "numerics.backend='xla' on 'cpu' has no CPU row tiles" in capsys.readouterr().err
    assert cli.main(["calibrate-tiles", "--config", "no_such_config", "--out", "x.json"]) == 2
    assert "no_such_config" in capsys.readouterr().err


def test_calibrate_tiles_check_names_a_tile_this_machine_rounds_differently(monkeypatch,
                                                                            capsys):
    """--check runs the table's tiles beside block_m rows: a table this machine holds exits
    0; where a tile's bits differ (a stand-in comparison that says so for 8 rows), exit 1 and
    one line naming the shape and the tile."""
    import importlib
    matmul_module = importlib.import_module("jrl.kernels.matmul")
    from jrl.kernels.contract import NumericalContract
    table = matmul_module.calibrate_row_tiles(NumericalContract.for_platform("cpu"),
                                              [(128, 64, False)])
    monkeypatch.setattr(matmul_module, "narrow_tile_agrees",
                        lambda contract, tile, k, n, transposed: tile != 8)
    setting = f"numerics.matmul_row_tiles={((128, 64, 0, 8, 16),)!r}"
    assert cli.main(["calibrate-tiles", "--config", "arith_tiny", "--check",
                     "--set", setting]) == 1
    out = capsys.readouterr().out
    assert "K=128, N=64, w_transposed=0: a 8-row tile rounds differently" in out
    assert "16-row" not in out and "1 tiles differ" in out
    monkeypatch.undo()
    if table:
        assert cli.main(["calibrate-tiles", "--config", "arith_tiny", "--check",
                         "--set", f"numerics.matmul_row_tiles={table!r}"]) == 0
        assert "all hold on this machine" in capsys.readouterr().out


@pytest.mark.slow
def test_calibrate_tiles_writes_a_config_that_trains_with_its_table(tmp_path, capsys):
    """One RL step of arith_tiny records its matmul shapes; the written config is the resolved
    one with the measured table, which holds on this machine and loads for jrl train."""
    out = tmp_path / "calibrated.json"
    assert cli.main(["calibrate-tiles", "--config", "arith_tiny", "--out", str(out)]) == 0
    calibrated = train.load_config(str(out), [])
    original = train.load_config("arith_tiny", [])
    table = calibrated.numerics.matmul_row_tiles
    assert calibrated.numerics == original.numerics.resolved_for().replace(
        matmul_row_tiles=table)
    # Every projection of the demo's model (D 128, MLP 384) was traced, whether or not a tile
    # other than 32 rows holds for it here.
    assert "shapes with other row tiles than 32" in capsys.readouterr().out
    import importlib
    assert importlib.import_module("jrl.kernels.matmul").check_row_tiles(calibrated.numerics) \
        == []
