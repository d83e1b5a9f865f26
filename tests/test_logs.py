"""jrl.logs: the library's lines go to the "jrl" logger; `configure` (what `jrl train
--verbosity` calls) shows them on stdout at the chosen level."""

import io
import logging

import pytest

from jrl import logs


@pytest.fixture(autouse=True)
def _restore_logger():
    handlers, level, propagate = list(logs.LOGGER.handlers), logs.LOGGER.level, \
        logs.LOGGER.propagate
    yield
    logs.LOGGER.handlers[:] = handlers
    logs.LOGGER.setLevel(level)
    logs.LOGGER.propagate = propagate


def test_info_lines_show_at_info_and_hide_at_warning():
    out = io.StringIO()
    logs.configure("info", stream=out)
    logs.info("step 1/2 | reward 0.5")
    logs.warning("2 reward errors")
    assert out.getvalue() == "step 1/2 | reward 0.5\nwarning: 2 reward errors\n"
    out = io.StringIO()
    logs.configure("warning", stream=out)      # replaces the handler installed above
    logs.info("step 2/2")
    logs.warning("disk nearly full")
    assert out.getvalue() == "warning: disk nearly full\n"
    assert sum(getattr(h, "_jrl_cli", False) for h in logs.LOGGER.handlers) == 1


def test_a_bad_verbosity_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"verbosity='loud': allowed values are \['debug', "
                                         r"'info', 'warning', 'error'\]"):
        logs.configure("loud")


def test_the_default_handler_follows_stdout(capsys):
    logs.configure("info")
    logs.info("to the captured stdout")
    assert capsys.readouterr().out == "to the captured stdout\n"


def test_unconfigured_the_library_adds_no_output_of_its_own(capsys):
    logs.LOGGER.handlers[:] = [logging.NullHandler()]
    logs.LOGGER.setLevel(logging.NOTSET)
    logs.LOGGER.propagate = True
    logs.info("quiet unless the application asks")
    assert capsys.readouterr().out == ""
