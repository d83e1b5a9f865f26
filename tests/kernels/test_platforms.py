"""Evidence for TPU and GPU without one: each kernel in Pallas's TPU interpreter (the TPU kernel
path: real grid, BlockSpecs, SMEM scalars) and each kernel lowered natively for TPU (Mosaic)
and GPU (Triton) through jax.export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, _grid
from jrl.kernels.rowwise import swiglu

from .helpers import assert_bitwise_equal, normal

try:
    from jax.experimental.pallas import tpu as pltpu
    pltpu.InterpretParams()
    HAVE_TPU_INTERPRET = True
except Exception:  # noqa: BLE001 - any failure means the interpreter is not usable here
    HAVE_TPU_INTERPRET = False

S = jax.ShapeDtypeStruct


def _cases(contract):
    """name -> (fn, example args): one small case per kernel."""
    rng = np.random.default_rng(0)
    q, k, v = normal(rng, (2, 20, 6, 16)), normal(rng, (2, 20, 2, 16)), normal(rng, (2, 20, 2, 16))
    pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
    valid = pos < jnp.asarray([[20], [13]])
    logits = normal(rng, (12, 300), scale=3.0)
    targets = jnp.asarray(rng.integers(0, 300, 12), jnp.int32)
    floor = jnp.sort(logits, axis=-1)[:, -40]
    # Gated delta: GQA 2 -> 4 heads, dk 16 != dv 24, T = 20 padded to whole chunks.
    delta = (normal(rng, (2, 20, 2, 16)), normal(rng, (2, 20, 2, 16)), normal(rng, (2, 20, 4, 24)),
             jnp.asarray(-rng.uniform(0.01, 1.0, (2, 20, 4)), jnp.float32),
             jnp.asarray(rng.uniform(0.0, 1.0, (2, 20, 4)), jnp.float32), valid,
             normal(rng, (2, 4, 16, 24), scale=0.3), jnp.asarray([1, 0], jnp.int32))
    return {
        "matmul": (lambda x, w: kernels.matmul(x, w, contract=contract),
                   (normal(rng, (20, 200)), normal(rng, (200, 130)))),
        "rms_norm": (lambda x, s: kernels.rms_norm(x, s, eps=1e-6, contract=contract),
                     (normal(rng, (20, 72)), normal(rng, (72,)))),
        # The input's RMSNorm and two projections of it in one kernel (N = 130 and 40: partial
        # last tiles of both weights).
        "projections": (lambda x, s, w1, w2: kernels.projections(
            x, [w1, w2], contract=contract, norm=(s, 1e-6)),
                        (normal(rng, (20, 72)), normal(rng, (72,)), normal(rng, (72, 130)),
                         normal(rng, (72, 40)))),
        "token_logprobs": (lambda l, t, f: tuple(kernels.token_logprobs(
            l, t, contract=contract, logit_floor=f)), (logits, targets, floor)),
        "attention": (lambda q, k, v, p, m: kernels.attention(
            q, k, v, q_positions=p, kv_positions=p, kv_valid=m, contract=contract),
                      (q, k, v, pos, valid)),
        "gated_delta": (lambda q, k, v, g, b, m, s, c: tuple(kernels.gated_delta_rule(
            q, k, v, g, b, valid=m, initial_state=s, state_chunk=c, contract=contract)), delta),
        # Pointwise math in fixed row tiles (20 rows: a partial last tile).
        "rowwise": (lambda g, u: swiglu(contract, contract.compute, g, u),
                    (normal(rng, (20, 128)), normal(rng, (20, 128)))),
    }


@pytest.mark.skipif(not HAVE_TPU_INTERPRET, reason="pltpu.InterpretParams unavailable")
def test_tpu_interpret_matches_cpu_interpret():
    """The TPU kernel path agrees with the CPU path (bitwise for matmul, docs/design.md's finding;
    within tolerance for the rest) and with the reference."""
    tiles = dict(matmul_block_m=16, matmul_block_n=128, matmul_block_k=128, norm_block_rows=8,
                 logprob_block_rows=8, vocab_chunk=128, attn_block_q=8, attn_block_k=128)
    tpu = _cases(NumericalContract(platform="tpu_interpret", **tiles))
    cpu = _cases(NumericalContract(platform="cpu", **tiles))
    ref = _cases(NumericalContract(platform="cpu", backend="xla"))
    for name, (fn, args) in tpu.items():
        got = jax.jit(fn)(*args)
        expected_cpu = jax.jit(cpu[name][0])(*args)
        expected_ref = ref[name][0](*args)
        if name == "matmul":
            assert_bitwise_equal(got, expected_cpu, name)
        for g, c, r in zip(jax.tree.leaves(got), jax.tree.leaves(expected_cpu),
                           jax.tree.leaves(expected_ref)):
            np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("platform, export_platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_lower_natively(platform, export_platform, dtype, monkeypatch):
    """Mosaic (TPU) and Triton (GPU) lowering accept every kernel, forward and backward, with
    the default tiles and awkward shapes (D = 72, GQA group 3, vocab 300, dk 16 != dv 24)."""
    monkeypatch.setattr(_grid, "_host_platform", lambda: platform)
    contract = NumericalContract.for_platform(platform, compute_dtype=dtype)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    for name, (fn, args) in _cases(contract).items():
        specs = [S(a.shape, a.dtype) for a in args]
        jax.export.export(jax.jit(fn), platforms=[export_platform],
                          disabled_checks=[triton])(*specs)
        if name not in ("attention", "gated_delta", "rowwise"):   # their backward is plain XLA
            def loss(*a, fn=fn):
                return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a)))
            jax.export.export(jax.jit(jax.grad(loss)), platforms=[export_platform],
                              disabled_checks=[triton])(*specs)
