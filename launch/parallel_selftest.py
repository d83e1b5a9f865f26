"""Multi-process self-test worker: a tiny model trained with the row-parallel step, params written
to .npz by process 0, Orbax checkpoints saved or restored by every process.

Launched by tests/parallel (and usable by hand) through jrl.cli.local_cluster:

    python -m jrl.cli.local_cluster --processes 2 --devices-per-process 2 -- \
        python -m launch.parallel_selftest --mesh 1,4,1 --steps 2 --out /tmp/p.npz

The same definitions (`tiny_setup`) build the single-process references in the tests.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from jrl.cli.train import flatten_params as flatten
from jrl.parallel import distributed


def tiny_setup(*, batch_rows: int = 8, seq: int = 16, seed: int = 0):
    """(model config, contract, optimizer, loss, host TrainState, host TrainBatch): hidden 64,
    2 layers, vocab 64; the same values on every process."""
    import jax

    from jrl import losses
    from jrl.kernels import NumericalContract
    from jrl.models import ModelConfig, init_params
    from jrl.train import OptimizerConfig, TrainBatch, create_train_state, make_optimizer

    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16)
    contract = NumericalContract(platform="cpu", matmul_block_m=32, matmul_block_n=64,
                                 matmul_block_k=32, attn_block_q=16, attn_block_k=16,
                                 norm_block_rows=32, logprob_block_rows=32, vocab_chunk=64)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 2, seq + 1, batch_rows)
    positions = np.arange(seq)[None]
    attn_mask = positions < lengths[:, None]
    batch = TrainBatch(
        tokens=rng.integers(0, config.vocab_size, (batch_rows, seq)).astype(np.int32),
        attn_mask=attn_mask,
        loss_mask=attn_mask & (positions >= 4),
        advantages=rng.normal(size=batch_rows).astype(np.float32),
        old_logp=(-4 * rng.random((batch_rows, seq))).astype(np.float32),
        behavior_logp=(-4 * rng.random((batch_rows, seq))).astype(np.float32),
        ref_logp=np.zeros((batch_rows, seq), np.float32),
        logit_floor=np.full((batch_rows, seq), -np.inf, np.float32))
    with jax.default_device(jax.local_devices()[0]):
        params = init_params(config, jax.random.PRNGKey(seed))
        state = create_train_state(params, optimizer, jax.random.PRNGKey(seed + 1))
        state = jax.tree.map(np.asarray, state)
    return config, contract, optimizer, losses.dapo(), state, batch




def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.parallel_selftest")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--out", default=None, help=".npz of the final state (process 0)")
    parser.add_argument("--save-ckpt", default=None, help="Orbax directory to save into")
    parser.add_argument("--restore-ckpt", default=None,
                        help="Orbax directory to restore the initial state from")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)

    info = distributed.initialize_from_args(args)
    import jax

    from jrl import parallel
    from jrl.train import parallel_step
    from jrl.train.checkpoint import Checkpointer

    config, contract, optimizer, loss_fn, host_state, host_batch = tiny_setup()
    data, fsdp, tensor = (int(v) for v in args.mesh.split(","))
    mesh = parallel.make_mesh(parallel.MeshConfig(data, fsdp, tensor))
    print(f"process {info.process_index}/{info.process_count} ({info.mode}): "
          f"{len(jax.local_devices())} local of {len(jax.devices())} devices, mesh "
          f"{dict(mesh.shape)}", flush=True)
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    state = parallel.host_to_global(host_state, shardings)
    if args.restore_ckpt:
        checkpointer = Checkpointer(args.restore_ckpt)
        state, _, meta = checkpointer.restore(state)
        checkpointer.close()
        print(f"restored step {int(parallel.global_to_host(state.step))} from "
              f"{args.restore_ckpt} (meta {meta})", flush=True)
    step = parallel.shard_train_step(
        parallel_step.make_parallel_train_step(config, contract, loss_fn, optimizer, mesh,
                                          num_micro_batches=args.micro_batches),
        shardings, parallel.batch_sharding(mesh))
    batch = parallel.host_to_global(host_batch, parallel.batch_sharding(mesh))
    metrics = {}
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s", flush=True)
    if args.save_ckpt:
        checkpointer = Checkpointer(args.save_ckpt)
        checkpointer.save(int(parallel.global_to_host(state.step)), state,
                          {"saved_by_processes": info.process_count})
        checkpointer.close()
    host = flatten(parallel.global_to_host(state))
    host.update({f"metrics{k}": v for k, v in flatten(parallel.global_to_host(metrics)).items()})
    if args.out and distributed.is_main_process():
        np.savez(args.out, **host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
