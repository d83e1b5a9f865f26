"""Test-wide setup. Must run before JAX creates its CPU backend.

8 host CPU devices: sharding tests (jrl.kernels: 4-device data parallel; later: 4 rollout + 4
train devices) need several devices on a CPU-only machine. Arrays and jitted computations still
default to device 0, so single-device tests are unaffected.
"""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICES_FLAG}=8").strip()

# Many tests build the same tiny model, sampler and train step; a persistent compilation cache
# lets every rebuild after the first skip XLA compilation, across tests and across the pytest
# workers of one run (make test runs two). It lives inside the clone (.jax_cache/, git-ignored),
# so a fresh clone starts cold, as CI does; JRL_TEST_COMPILATION_CACHE points it elsewhere.
import jax  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JRL_TEST_COMPILATION_CACHE",
                                 os.path.join(_REPO, ".jax_cache", "tests")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
