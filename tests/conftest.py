"""Test-wide setup. Must run before JAX creates its CPU backend.

8 host CPU devices: sharding tests (jrl.kernels: 4-device data parallel; later: 4 rollout + 4
train devices) need several devices on a CPU-only machine. Arrays and jitted computations still
default to device 0, so single-device tests are unaffected.
"""

import os
import signal
import subprocess
import sys

# A shell that starts the suite in the background ignores SIGINT, and Python then installs no
# KeyboardInterrupt handler; the Ctrl-C tests (pipeline/test_faults.py, test_run.py) need it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICES_FLAG}=8").strip()

# Tests compile for speed, not for fast programs: they are tiny, so compiling dominates.
# - LLVM -O0 and no expensive LLVM passes (jax_disable_most_optimizations): 1.5-1.7x less time
#   per test file (sampling/test_engine, train/test_step, pipeline/test_async).
# - XLA's older CPU fusion emitters (--xla_cpu_use_fusion_emitters=false): the new ones run an
#   MLIR pipeline per fusion, about half of all compile time. A cold `make test` on 2 cores went
#   from 679 to about 330 s of test time (2026-12).
# The HLO passes, which decide fusion and so the floating-point order, still run, and no fast math
# is on. Every bitwise test passes in this mode as with XLA's defaults, except the row-parallel
# train step's equality across meshes (docs/design.md, invariant 4): with the older emitters the gradients
# of different meshes differ in the last bit, so tests/parallel/test_step.py computes its runs in
# a child process with the default emitters (default_emitters_env). Child processes inherit the
# setting. test_bitwise_at_full_optimization re-runs a sampler bitwise case with XLA's defaults in
# a child process; JRL_TEST_FULL_OPTIMIZATION=1 (make test-slow) keeps the defaults for a whole
# session; JRL_TEST_LEGACY_EMITTERS=0 keeps -O0 with the default emitters.
_LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag`: XLA ends the process on an unknown XLA_FLAGS
    entry, so a jaxlib that dropped the older emitters must not get it (checked in a child)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                          capture_output=True, timeout=300).returncode == 0


if os.environ.get("JRL_TEST_FULL_OPTIMIZATION") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    # Checked once per pytest session: the xdist workers inherit the result in the environment.
    if ("--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
            and os.environ.get("JRL_TEST_LEGACY_EMITTERS") != "0"):
        if _xla_knows(_LEGACY_EMITTERS_FLAG):
            os.environ["XLA_FLAGS"] += f" {_LEGACY_EMITTERS_FLAG}"
        else:
            os.environ["JRL_TEST_LEGACY_EMITTERS"] = "0"


def default_emitters_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child that compiles with XLA's default CPU fusion
    emitters (the forced device count and the other flags kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != _LEGACY_EMITTERS_FLAG]
    # JRL_TEST_LEGACY_EMITTERS=0: a child that imports this conftest does not add the flag back.
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JRL_TEST_LEGACY_EMITTERS="0", **overrides)


# No persistent compilation cache: with jaxlib 0.10.2 on the CPU, writing an entry while another
# thread of the process compiles or runs crashed a test worker (a segfault in
# compilation_cache.put_executable_and_time on a pipeline test's rollout thread), and pytest-xdist
# then waited forever for the lost worker. Opt in with JRL_TEST_COMPILATION_CACHE=DIR.
import jax  # noqa: E402

if os.environ.get("JRL_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["JRL_TEST_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The slowest files first (seconds of test time on 2 CPU cores, measured in 2026-12 with
# --durations=0), then the rest in collection order: `make test` spreads whole files over two workers
# in this order (pytest-xdist --dist loadfile --no-loadscope-reorder), so the long files start
# early and the short ones fill the gaps. xdist's own order (most tests first) left one worker
# idle for the last 30 s of the pipeline session while the other ran a long file it had started
# late. Order only: a file missing here still runs, just later.
SLOWEST_FIRST = (
    "sampling/test_speculative.py",         # ~180 s
    "sampling/test_bitwise.py",             # ~155
    "pipeline/test_async.py",               # ~90
    "pipeline/test_fast_rollout_run.py",    # ~65
    "parallel/test_step.py",                # ~63
    "sampling/test_moe_routes.py",          # ~62
    "models/test_gpu_lowering.py",          # ~59
    "parallel/test_expert_parallel.py",     # ~54
    "sampling/test_speculative_mtp.py",     # ~55
    "sampling/test_shared_prefill.py",      # ~48
    "sampling/test_multiturn.py",           # ~47
    "pipeline/test_moe_run.py",             # ~39
    "pipeline/test_multiturn_run.py",       # ~37
    "pipeline/test_interrupt.py",           # ~31
    "models/test_nnx_model.py",             # ~30
    "models/test_mtp.py",                   # ~30
    "train/test_step.py",                   # ~30
    "models/test_moe_replay.py",            # ~29
    "sampling/test_cpu_tiles.py",           # ~29
    "launch/test_bad_input.py",             # ~24
    "pipeline/test_real_formats.py",        # ~23
    "pipeline/test_run.py",                 # ~23
    "sampling/test_engine.py",              # ~22
    "models/test_moe_models.py",            # ~21
    "kernels/test_moe.py",                  # ~21
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    tests_dir = os.path.dirname(__file__)

    def key(item):
        relative = os.path.relpath(str(item.path), tests_dir).replace(os.sep, "/")
        return rank.get(relative, len(rank))

    items.sort(key=key)    # stable: tests keep their order within a file
