"""The isolations the process sandbox's tests run under on this machine: "rlimits" everywhere,
"namespaces" where it can be set up (skipped with the reason elsewhere)."""

import pytest

from jrl.envs.process_sandbox import namespace_problem

NAMESPACE_PROBLEM = namespace_problem()

needs_namespaces = pytest.mark.skipif(
    NAMESPACE_PROBLEM is not None,
    reason=f"namespace isolation is not available on this machine: {NAMESPACE_PROBLEM}")

# Parametrize a test over both isolations: pytest.mark.parametrize("isolation", BOTH).
BOTH = ["rlimits", pytest.param("namespaces", marks=needs_namespaces)]
