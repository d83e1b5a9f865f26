"""Test-wide setup. Must run before JAX creates its CPU backend.

8 host CPU devices: sharding tests (jrl.kernels: 4-device data parallel; later: 4 rollout + 4
train devices) need several devices on a CPU-only machine. Arrays and jitted computations still
default to device 0, so single-device tests are unaffected.
"""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICES_FLAG}=8").strip()

# No persistent compilation cache: with jaxlib 0.10.2 on the CPU, writing an entry while another
# thread of the process compiles or runs crashed a test worker (a segfault in
# compilation_cache.put_executable_and_time on a pipeline test's rollout thread), and pytest-xdist
# then waited forever for the lost worker. Opt in with JRL_TEST_COMPILATION_CACHE=DIR.
import jax  # noqa: E402

if os.environ.get("JRL_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["JRL_TEST_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
