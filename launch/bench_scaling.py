"""Benchmark: weak scaling of the row-parallel train step over CPU processes, and weight-transfer
time against parameter size. Prints tables; asserts nothing about time.

    python -m launch.bench_scaling                 # everything (about 2-3 minutes on 2 cores)
    python -m launch.bench_scaling --processes 1 2 --sizes-mb 4 16

1. Weak scaling: 1, 2, 4 processes (jrl.cli.local_cluster, one CPU device each), and for
   contrast 1 process with 2 and 4 devices; fsdp over all devices, a fixed number of rows per
   device (so the global batch grows with the devices); steps/s and rows/s after one warm-up
   step. With fewer cores than devices the devices share cores: read rows/s against the core
   count.
2. Weight transfer: a params-sized pytree (12 float32 leaves of [rows, 1024]) moved
   from the train devices (FSDP-sharded) to disjoint rollout devices (replicated), in one
   process with jax.device_put; and between two processes (one device each) with a ppermute
   over gloo, which is how a sampler on other hosts would receive weights.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

_RESULT = "BENCH_RESULT "


# ------------------------------------------------------------------------------------------------
# Workers (run inside jrl.cli.local_cluster processes)

def _worker_scaling(args) -> None:
    from jrl.parallel import distributed
    info = distributed.initialize()
    import jax

    from jrl import losses, parallel
    from jrl.kernels import NumericalContract
    from jrl.models import ModelConfig, init_params
    from jrl.train import create_train_state, parallel_step
    from launch.parallel_selftest import tiny_setup

    _, _, optimizer, _, _, _ = tiny_setup()
    config = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32)
    contract = NumericalContract(platform="cpu", matmul_block_m=64, matmul_block_n=128,
                                 matmul_block_k=64, attn_block_q=32, attn_block_k=32,
                                 norm_block_rows=64, logprob_block_rows=64, vocab_chunk=256)
    n = jax.process_count() * len(jax.local_devices())
    rows = args.rows_per_device * n
    _, _, _, _, _, host_batch = tiny_setup(batch_rows=rows, seq=args.seq)  # tokens < 64
    with jax.default_device(jax.local_devices()[0]):
        host_state = jax.tree.map(
            lambda x: jax.device_get(x),
            create_train_state(init_params(config, jax.random.PRNGKey(0)), optimizer,
                               jax.random.PRNGKey(1)))
    mesh = parallel.make_mesh(parallel.MeshConfig(1, -1, 1))
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    step = parallel.shard_train_step(
        parallel_step.make_parallel_train_step(config, contract, losses.dapo(), optimizer, mesh),
        shardings, parallel.batch_sharding(mesh))
    state = parallel.host_to_global(host_state, shardings)
    batch = parallel.host_to_global(host_batch, parallel.batch_sharding(mesh))
    state, _ = step(state, batch)          # compile + warm-up
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / args.steps
    if info.process_index == 0:
        print(_RESULT + json.dumps({"processes": jax.process_count(), "devices": n,
                                    "rows": rows, "step_s": seconds}), flush=True)


def _worker_transfer(args) -> None:
    from jrl.parallel import distributed
    distributed.initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if jax.process_count() != 2 or len(jax.local_devices()) != 1:
        raise SystemExit("transfer worker: run with 2 processes x 1 device")
    mesh = Mesh(np.array(jax.devices()), ("x",))
    # Source on process 0's device, destination on process 1's: row 0 / row 1 of [2, ...].
    send = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "x", [(0, 1)]), mesh=mesh,
                                 in_specs=P("x"), out_specs=P("x")))
    results = []
    for size_mb in args.sizes_mb:
        leaves = _params_like(size_mb)
        stacked = [jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("x")), np.asarray(leaf)[None]) for leaf in leaves]
        out = send(stacked)
        jax.block_until_ready(out)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(send(stacked))
            times.append(time.perf_counter() - start)
        # Check the data arrived: process 1 holds process 0's values.
        if jax.process_index() == 1:
            got = np.asarray(out[0].addressable_shards[0].data)[0]
            assert got.shape == leaves[0].shape
        results.append({"size_mb": size_mb, "seconds": statistics.median(times)})
    if jax.process_index() == 0:
        print(_RESULT + json.dumps(results), flush=True)


def _params_like(size_mb: float):
    """12 float32 [rows, 1024] leaves (rows a multiple of 8), about size_mb MB in total."""
    import numpy as np
    width, num_leaves = 1024, 12
    rows = max(int(size_mb * 2**20 / 4 / (width * num_leaves)) // 8 * 8, 8)
    rng = np.random.default_rng(0)
    return [rng.standard_normal((rows, width), dtype=np.float32) for _ in range(num_leaves)]


# ------------------------------------------------------------------------------------------------
# Driver

def _launch(module_args: list[str], processes: int, devices_per_process: int = 1):
    from jrl.cli import local_cluster
    out = io.StringIO()
    status = local_cluster.run([sys.executable, "-m", "launch.bench_scaling", *module_args],
                               processes=processes, devices_per_process=devices_per_process,
                               timeout_s=600, out=out)
    text = out.getvalue()
    if status != 0:
        raise RuntimeError(f"benchmark worker failed (status {status}):\n{text[-4000:]}")
    line = next(l for l in text.splitlines() if _RESULT in l)
    return json.loads(line.split(_RESULT, 1)[1])


def bench_scaling(processes: list[int], rows_per_device: int, seq: int, steps: int) -> None:
    print(f"\nWeak scaling: row-parallel train step (fsdp over all devices), {rows_per_device} "
          f"rows x {seq} tokens per device, {os.cpu_count()} CPU cores; N processes x 1 device "
          "(gloo between processes) and 1 process x N devices (in-process collectives)")
    print(f"{'processes':>9} {'devices':>7} {'rows':>6} {'step s':>8} {'steps/s':>8} "
          f"{'rows/s':>8} {'efficiency':>10}")
    base = None
    layouts = [(count, 1) for count in processes]
    layouts += [(1, count) for count in processes if count > 1]
    for count, per_process in layouts:
        r = _launch(["--worker", "scaling", "--rows-per-device", str(rows_per_device),
                     "--seq", str(seq), "--steps", str(steps)], count, per_process)
        rows_per_s = r["rows"] / r["step_s"]
        base = base or rows_per_s
        print(f"{r['processes']:>9} {r['devices']:>7} {r['rows']:>6} {r['step_s']:>8.3f} "
              f"{1 / r['step_s']:>8.2f} {rows_per_s:>8.1f} "
              f"{rows_per_s / (base * r['devices']):>10.2f}", flush=True)
    print(f"efficiency = rows/s / (devices x rows/s on 1 device); with more devices than the "
          f"{os.cpu_count()} cores it cannot exceed cores / devices")


def bench_transfer_in_process(sizes_mb: list[float], repeats: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jrl import parallel

    rollout, train = parallel.split_devices(jax.devices()[:4], 2, 2)
    train_mesh = parallel.make_mesh(parallel.MeshConfig(1, -1, 1), train)
    rollout_mesh = parallel.make_mesh(parallel.MeshConfig(1, 1, -1), rollout)
    print(f"\nWeight transfer in one process: train devices {[d.id for d in train]} (rows of "
          f"every leaf FSDP-sharded) -> rollout devices {[d.id for d in rollout]} (replicated), "
          "jax.device_put, median of", repeats)
    print(f"{'MB':>8} {'seconds':>9} {'GB/s':>7}")
    for size_mb in sizes_mb:
        leaves = _params_like(size_mb)
        src = [jax.device_put(x, NamedSharding(train_mesh, P("fsdp"))) for x in leaves]
        dst = NamedSharding(rollout_mesh, P())
        jax.block_until_ready(jax.device_put(src, dst))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            moved = jax.block_until_ready(jax.device_put(src, dst))
            times.append(time.perf_counter() - start)
        assert np.array_equal(np.asarray(moved[0]), leaves[0])
        seconds = statistics.median(times)
        megabytes = sum(x.nbytes for x in leaves) / 2**20
        print(f"{megabytes:>8.1f} {seconds:>9.4f} {megabytes / 1024 / seconds:>7.2f}",
              flush=True)


def bench_transfer_between_processes(sizes_mb: list[float], repeats: int) -> None:
    print("\nWeight transfer between two processes (one device each, ppermute over gloo on "
          "127.0.0.1), median of", repeats)
    print(f"{'MB':>8} {'seconds':>9} {'GB/s':>7}")
    results = _launch(["--worker", "transfer", "--repeats", str(repeats), "--sizes-mb",
                       *map(str, sizes_mb)], processes=2)
    for r in results:
        megabytes = sum(x.nbytes for x in _params_like(r["size_mb"])) / 2**20
        print(f"{megabytes:>8.1f} {r['seconds']:>9.4f} {megabytes / 1024 / r['seconds']:>7.2f}",
              flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.bench_scaling")
    parser.add_argument("--worker", choices=("scaling", "transfer"), default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows-per-device", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=(),
                        choices=("scaling", "transfer", "transfer-processes"))
    args = parser.parse_args(argv)
    if args.worker == "scaling":
        _worker_scaling(args)
        return 0
    if args.worker == "transfer":
        _worker_transfer(args)
        return 0
    # Driver: this process needs 4 host devices for the in-process transfer.
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=4").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    if "scaling" not in args.skip:
        bench_scaling(args.processes, args.rows_per_device, args.seq, args.steps)
    if "transfer" not in args.skip:
        bench_transfer_in_process(args.sizes_mb, args.repeats)
    if "transfer-processes" not in args.skip:
        bench_transfer_between_processes(args.sizes_mb, args.repeats)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
