"""PythonEnv(sandbox="process"): the Python tool on real CPython in the process sandbox."""

import pytest

from jrl.data import PromptExample
from jrl.envs import ProcessLimits, PythonEnv, StepResult
from jrl.envs.python_env import process_python_env
from jrl.plugins import load_plugin
from tests.envs.sandbox_isolations import BOTH, needs_namespaces

EXAMPLE = PromptExample(id=0, question="What is 3 + 4?", answer="7")


def _env(isolation: str, **options) -> PythonEnv:
    env = PythonEnv(sandbox="process", isolation=isolation, **options)
    assert env.reset(EXAMPLE) == "What is 3 + 4?"
    return env


def _block(code: str) -> str:
    return f"Let me compute.\n```python\n{code}\n```\n"


@pytest.mark.parametrize("isolation", BOTH)
@pytest.mark.parametrize("code", [
    "print(3 + 4)",
    "x = 3\nx * 2",
    "print('a')\n[1, 2]",
    "'text'",
    "x = 1",
    "total = 0\nfor i in range(5):\n    total += i\nprint(total)",
])
def test_observations_match_the_ast_sandbox(isolation, code):
    """For the programs both can run, the observation is the same text."""
    ast = PythonEnv()
    ast.reset(EXAMPLE)
    assert _env(isolation).step(_block(code)) == ast.step(_block(code))


@pytest.mark.parametrize("isolation", BOTH)
def test_real_python_runs(isolation):
    """What the AST sandbox refuses: imports, attributes, def, lambda, try."""
    code = ("import math, fractions\n"
            "def half(x):\n    return fractions.Fraction(x, 2)\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    pass\n"
            "print(math.gcd(12, 18), half(3), sorted([3, 1], key=lambda v: -v))")
    assert _env(isolation).step(_block(code)) == StepResult(observation="6 3/2 [3, 1]",
                                                            tool_call=True)


@pytest.mark.parametrize("isolation", BOTH)
def test_errors_and_limits_are_observed(isolation):
    env = _env(isolation, process_limits=ProcessLimits(timeout_s=1.0))
    for code, observation in [
        ("print(1 / 0)", "error: ZeroDivisionError: division by zero"),
        ("print(y)", "error: NameError: name 'y' is not defined"),
        ("import time\ntime.sleep(60)", "error: the wall-clock limit of 1.0 s was hit "
                                        "(ProcessLimits.timeout_s)"),
    ]:
        result = env.step(_block(code))
        assert result == StepResult(observation=observation[:200], tool_call=True,
                                    tool_error=True), result


def test_observation_is_cut_and_truncation_is_marked():
    env = _env("rlimits", max_observation_chars=10)
    assert env.step(_block("print(12345678901234)")).observation == "1234567..."
    cut = _env("rlimits", process_limits=ProcessLimits(output_bytes=4))
    assert cut.step(_block("print(123456)")).observation == "1234..."


def test_final_answer_is_graded():
    assert _env("rlimits").step("The answer is 7.") == StepResult(observation="", reward=1.0,
                                                                  done=True)


def test_options_are_validated():
    with pytest.raises(ValueError, match="PythonEnv: sandbox='docker' is not allowed; allowed: "
                                         r"\('ast', 'process'\)"):
        PythonEnv(sandbox="docker")
    with pytest.raises(ValueError, match="isolation='none' is not allowed"):
        PythonEnv(sandbox="process", isolation="none")


@needs_namespaces
def test_the_config_factory_makes_a_namespaced_process_tool():
    factory = load_plugin("env.name", "jrl.envs.python_env:process_python_env")
    assert factory is process_python_env
    env = factory()
    assert env.sandbox == "process" and env._process.isolation == "namespaces"
    env.reset(EXAMPLE)
    assert env.step(_block("import os\nprint(os.getcwd())")).observation == "/sandbox"


def test_the_config_chooses_the_python_tools_sandbox():
    """env.sandbox reaches the python tool through the run's environment factory; it is
    refused for another environment and outside SANDBOXES."""
    from jrl.pipeline.config.tools import apply_overrides
    from jrl.pipeline.config import RunConfig
    config = apply_overrides(RunConfig(), ["env.name=python", "env.sandbox=process",
                                           "sampling.max_new_tokens=64"])
    factory = config.env.environment_factory(config.rollout.reward_mode)
    assert factory.keywords == {"reward_mode": "auto", "sandbox": "process"}
    with pytest.raises(ValueError, match="env.sandbox='process' runs the python tool's code: it "
                                         "needs env.name='python'"):
        apply_overrides(RunConfig(), ["env.name=calculator", "env.sandbox=process",
                                      "sampling.max_new_tokens=64"])
    with pytest.raises(ValueError, match="env.sandbox='docker': allowed values are"):
        apply_overrides(RunConfig(), ["env.name=python", "env.sandbox=docker",
                                      "sampling.max_new_tokens=64"])
