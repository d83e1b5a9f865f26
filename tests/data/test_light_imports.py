import subprocess
import sys


def test_data_rewards_metrics_do_not_import_jax():
    # These packages run in data-loading and logging processes that must not pay for (or
    # initialise) jax; only plain Python and numpy are allowed.
    code = (
        "import sys, jrl.data, jrl.rewards, jrl.metrics\n"
        "heavy = ('jax', 'jaxlib', 'flax', 'optax')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]"
