"""jrl.plugins: user code named in a config as "package.module:attribute" or
"path/to/file.py:attribute"; every failure is one ValueError naming the key."""

import sys

import pytest

from jrl.plugins import check_plugin_spec, is_plugin_spec, load_plugin


def test_a_module_path_and_a_file_path_both_load(tmp_path):
    assert load_plugin("algorithm.factory", "json:dumps").__name__ == "dumps"
    source = tmp_path / "my_reward.py"
    source.write_text("SCALE = 3\n\ndef reward(response, example):\n    return SCALE\n")
    reward = load_plugin("rollout.reward_fn", f"{source}:reward")
    assert reward("text", None) == 3
    # Loaded once: a second load gives the same function, from a module sys.modules holds.
    assert load_plugin("rollout.reward_fn", f"{source}:reward") is reward
    assert sys.modules[reward.__module__].SCALE == 3


@pytest.mark.parametrize("value", ["", "json", "json:", ":dumps", "json:not-a-name"])
def test_a_malformed_value_names_the_key_and_the_allowed_forms(value):
    assert not is_plugin_spec(value)
    with pytest.raises(ValueError, match=r"rollout\.reward_fn=.*'package\.module:function'"):
        check_plugin_spec("rollout.reward_fn", value)


def test_each_failure_is_one_line_naming_key_value_and_cause(tmp_path):
    with pytest.raises(ValueError, match=r"^rollout\.reward_fn='no_such_pkg\.mod:f': no module "
                                         r"named 'no_such_pkg'"):
        load_plugin("rollout.reward_fn", "no_such_pkg.mod:f")
    with pytest.raises(ValueError, match=r"'json' has no attribute 'dumpz' \(it has: .*dumps"):
        load_plugin("rollout.reward_fn", "json:dumpz")
    with pytest.raises(ValueError, match=r"no file '.*missing\.py'"):
        load_plugin("rollout.reward_fn", f"{tmp_path / 'missing.py'}:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    with pytest.raises(ValueError, match=r"running '.*broken\.py' failed: ModuleNotFoundError"):
        load_plugin("rollout.reward_fn", f"{broken}:f")
    # The failed file is not left half-imported: fixed, it loads.
    broken.write_text("def f(response, example):\n    return 1.0\n")
    assert load_plugin("rollout.reward_fn", f"{broken}:f")("", None) == 1.0
    raising = tmp_path / "raising_pkg"
    raising.mkdir()
    (raising / "__init__.py").write_text("raise RuntimeError('bad package state')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"importing 'raising_pkg' failed: RuntimeError: bad "
                                             "package state"):
            load_plugin("env.name", "raising_pkg:factory")
    finally:
        sys.path.remove(str(tmp_path))
