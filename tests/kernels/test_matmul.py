"""jrl.kernels.matmul: reference agreement, determinism, batch invariance, gradients."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, reference

from .helpers import ATOL, DTYPES, assert_bitwise_equal, bits, normal

# The module (jrl.kernels.matmul the attribute is the dispatching function).
matmul_module = importlib.import_module("jrl.kernels.matmul")

# Small tiles so a few hundred rows cross several M, N and K tiles.
SMALL = dict(matmul_block_m=16, matmul_block_n=128, matmul_block_k=128)


@functools.lru_cache(maxsize=None)
def _jitted(contract):
    return jax.jit(lambda x, w: kernels.matmul(x, w, contract=contract))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_reference(dtype):
    rng = np.random.default_rng(0)
    contract = NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)
    x, w = normal(rng, (2, 19, 200)), normal(rng, (200, 150))      # leading dims; K, N unaligned
    y = _jitted(contract)(x, w)
    assert y.shape == (2, 19, 150) and y.dtype == jnp.dtype(dtype)
    expected = reference.matmul(x.astype(dtype), w.astype(dtype), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, atol=ATOL[dtype] * 10,
                               rtol=1e-2 if dtype == "bfloat16" else 1e-5)


def test_matmul_deterministic_bitwise():
    rng = np.random.default_rng(1)
    x, w = normal(rng, (70, 200)), normal(rng, (200, 150))
    f = _jitted(NumericalContract(platform="cpu", **SMALL))
    first = f(x, w)
    for _ in range(2):
        assert_bitwise_equal(f(x, w), first, "repeat")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_matmul_batch_invariant_bitwise(dtype, tiles):
    rng = np.random.default_rng(2)
    contract = NumericalContract(platform="cpu", compute_dtype=dtype,
                                 **(SMALL if tiles == "small" else {}))
    x, w = normal(rng, (150, 300)), normal(rng, (300, 260))
    f = _jitted(contract)
    full = f(x, w)
    for start, stop in [(0, 1), (3, 4), (149, 150), (5, 8), (40, 47), (64, 128), (17, 81),
                        (9, 140)]:
        assert_bitwise_equal(f(x[start:stop], w), full[start:stop], f"rows {start}:{stop}")


def test_xla_matmul_is_not_batch_invariant_bitwise():
    """The control: plain jnp.dot gives a row different bits alone than inside a batch of 64
    (XLA CPU picks a matrix-vector path for few rows), while the Pallas kernel does not."""
    rng = np.random.default_rng(3)
    x, w = normal(rng, (64, 300)), normal(rng, (300, 260))
    xla = _jitted(NumericalContract(platform="cpu", backend="xla"))
    assert not np.array_equal(bits(xla(x[:1], w)), bits(xla(x, w)[:1]))
    pallas = _jitted(NumericalContract(platform="cpu"))
    assert_bitwise_equal(pallas(x[:1], w), pallas(x, w)[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_grads_match_reference(dtype):
    rng = np.random.default_rng(4)
    contract = NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)
    x, w = normal(rng, (3, 11, 140)), normal(rng, (140, 130))        # float32 "params"
    dy = normal(rng, (3, 11, 130))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * dy)

    ours = jax.jit(jax.grad(loss(lambda x, w: kernels.matmul(x, w, contract=contract)), (0, 1)))
    ref = jax.grad(loss(lambda x, w: reference.matmul(x.astype(jnp.float32),
                                                      w.astype(jnp.float32))), (0, 1))
    for got, want in zip(ours(x, w), ref(x, w)):
        assert got.dtype == jnp.float32                            # grads in the input dtype
        np.testing.assert_allclose(got, want, rtol=2e-2 if dtype == "bfloat16" else 1e-5,
                                   atol=0.3 if dtype == "bfloat16" else 1e-4)


def test_matmul_xla_backend_casts_like_kernel():
    rng = np.random.default_rng(5)
    x, w = normal(rng, (5, 40)), normal(rng, (40, 30))
    for dtype in DTYPES:
        for backend in ("xla", "pallas"):
            y = kernels.matmul(x, w, contract=NumericalContract(platform="cpu", backend=backend,
                                                                 compute_dtype=dtype))
            assert y.dtype == jnp.dtype(dtype) and y.shape == (5, 30)


def test_matmul_row_tile_follows_the_contracts_table():
    """The rule, on a table allowing 8, 16, 64 and 128 rows at K = 300, N = 260 (block_m 32):
    1, 3, 5 and 8 rows -> 8 (the narrowest allowed tile >= m), 9 -> 16, 17 and 32 -> 32 (no
    allowed tile in [m, 32)); 1024 rows -> 128 (the widest allowed <= m); 300 -> 64, because
    128-row tiles would pad 300 rows to 384 while 32-row tiles pad to 320, as 64 does
    ((-300) % 128 = 84, (-300) % 32 = (-300) % 64 = 20); 40 -> 32 (64 > 40). Another shape,
    or the transposed flag, has no entry: 32 everywhere."""
    contract = NumericalContract(platform="cpu", matmul_block_m=32,
                                 matmul_row_tiles=((300, 260, 0, 128, 8, 64, 16),))
    rows = (1, 3, 5, 8, 9, 17, 32, 1024, 300, 40)
    assert [matmul_module.row_tile(contract, m, 300, 260, False) for m in rows] == \
        [8, 8, 8, 8, 16, 32, 32, 128, 64, 32]
    assert {matmul_module.row_tile(contract, m, 300, 261, False) for m in rows} == {32}
    assert {matmul_module.row_tile(contract, m, 300, 260, True) for m in rows} == {32}
    assert {matmul_module.row_tile(contract.replace(matmul_row_tiles=()), m, 300, 260, False)
            for m in rows} == {32}


def test_matmul_probes_nothing_while_a_program_is_traced(monkeypatch):
    """Which row tile a call runs is the contract's: tracing and running matmuls with and
    without a row-tile table never runs a probe program."""
    def no_probe(*args):
        raise AssertionError("a probe ran while a program was traced")

    monkeypatch.setattr(matmul_module, "_run_once", no_probe)
    rng = np.random.default_rng(5)
    w = normal(rng, (300, 260))
    for table in ((), ((300, 260, 0, 8, 64),)):
        contract = NumericalContract(platform="cpu", matmul_block_m=32, matmul_row_tiles=table)
        for rows in (5, 100):
            xs = normal(rng, (rows, 300))
            y = jax.jit(lambda x, w, c=contract: kernels.matmul(x, w, contract=c))(xs, w)
            assert y.shape == (rows, 260)


def _calibrated_rows_equal_block_rows(contract, k, n, w_transposed, rng):
    """For every tile contract's table allows at (k, n, w_transposed): a call of that many rows
    (running that tile) equals the same rows run on a table-less contract (block_m rows)."""
    plain = contract.replace(matmul_row_tiles=())
    w = normal(rng, (n, k) if w_transposed else (k, n))
    tiles = contract.row_tiles(k, n, w_transposed)
    for tile in tiles:
        x = normal(rng, (tile, k))
        assert matmul_module.row_tile(contract, tile, k, n, w_transposed) == tile
        got = kernels.matmul(x, w, contract=contract, transpose_w=w_transposed)
        want = kernels.matmul(x, w, contract=plain, transpose_w=w_transposed)
        assert_bitwise_equal(got, want, f"K={k}, N={n}, transposed={w_transposed}: {tile} rows")
    return tiles


def test_calibrated_row_tiles_keep_the_bits_bitwise():
    """calibrate_row_tiles keeps a tile only where this machine rounds it like block_m rows:
    every kept tile, run through the kernel, gives the bits of 32-row tiles (narrow tiles at
    K = 300, N = 260, plain and transposed; wide ones at SmolLM2's MLP down projection, K =
    1536, N = 576). Which tiles are kept is the machine's property; where none is, there is
    nothing to compare, and the test says so."""
    rng = np.random.default_rng(6)
    base = NumericalContract(platform="cpu", matmul_block_m=32)
    shapes = [(300, 260, False), (300, 260, True), (1536, 576, False)]
    table = matmul_module.calibrate_row_tiles(base, shapes)
    contract = base.replace(matmul_row_tiles=table)
    assert matmul_module.check_row_tiles(contract) == []
    kept = [_calibrated_rows_equal_block_rows(contract, *shape, rng) for shape in shapes]
    if not any(kept):
        pytest.skip("this machine's library rounds no other row tile like 32 rows at these "
                    "shapes: the table is empty")


def test_calibration_leaves_out_a_tile_that_rounds_differently(monkeypatch):
    """Where every narrower tile's bits differ (a probe that perturbs narrow tiles' outputs),
    the calibrated table allows no narrow tile, a 5-row call pads to matmul_block_m, and its
    rows equal the full call's; check_row_tiles names a table that claims such a tile."""
    contract = NumericalContract(platform="cpu", matmul_block_m=32, matmul_block_n=1 << 17)
    real_probe = matmul_module._probe.__wrapped__

    def probe(tile_contract, k, n, w_transposed):
        out = real_probe(tile_contract, k, n, w_transposed)
        return out if tile_contract.matmul_block_m == 32 else np.nextafter(out, np.inf)

    monkeypatch.setattr(matmul_module, "_probe", functools.lru_cache(maxsize=None)(probe))
    matmul_module.narrow_tile_agrees.cache_clear()
    try:
        table = matmul_module.calibrate_row_tiles(contract, [(300, 260, False)])
        assert all(tile > 32 for entry in table for tile in entry[3:])
        calibrated = contract.replace(matmul_row_tiles=table)
        assert matmul_module.row_tile(calibrated, 5, 300, 260, False) == 32
        rng = np.random.default_rng(7)
        x, w = normal(rng, (32, 300)), normal(rng, (300, 260))
        f = jax.jit(lambda x, w: kernels.matmul(x, w, contract=calibrated))
        assert_bitwise_equal(f(x[:5], w), f(x, w)[:5], "padded to the full tile")
        claimed = contract.replace(matmul_row_tiles=((300, 260, 0, 8),))
        assert matmul_module.check_row_tiles(claimed) == [
            "K=300, N=260, w_transposed=0: a 8-row tile rounds differently from 32-row tiles "
            "here"]
    finally:
        matmul_module.narrow_tile_agrees.cache_clear()


def test_recording_shapes_collects_the_traced_calls():
    """recording_shapes sees every emulated call traced inside it, cached or not: a [5, 40] x
    [40, 30] call and its transposed-weight twin give (40, 30, False) and (40, 30, True)."""
    rng = np.random.default_rng(9)
    contract = NumericalContract(platform="cpu")
    x, w = normal(rng, (5, 40)), normal(rng, (40, 30))
    kernels.matmul(x, w, contract=contract)            # traced once before the recorder
    with matmul_module.recording_shapes() as shapes:
        kernels.matmul(x, w, contract=contract)
        kernels.matmul(x, w.T, contract=contract, transpose_w=True)
    assert shapes == {(40, 30, False), (40, 30, True)}
