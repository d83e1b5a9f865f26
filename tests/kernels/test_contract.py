"""NumericalContract validation and the backend choice of the public API."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, _grid, reference


def test_contract_is_hashable_and_round_trips():
    contract = NumericalContract(platform="cpu", compute_dtype="bfloat16")
    again = NumericalContract.from_dict(json.loads(contract.to_json()))
    assert again == contract and hash(again) == hash(contract)
    contract.check_compatible(NumericalContract.from_dict(contract.to_dict()))
    with pytest.raises(ValueError, match="attn_block_k"):
        contract.check_compatible(contract.replace(attn_block_k=64))


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu", "tpu_interpret"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_tiles_are_valid_everywhere(platform, dtype):
    NumericalContract(platform=platform, compute_dtype=dtype)
    NumericalContract.for_platform(platform, compute_dtype=dtype)


@pytest.mark.parametrize("changes, match", [
    (dict(platform="tpu", matmul_block_n=96), "matmul_block_n=96: on TPU must be a multiple"),
    (dict(platform="tpu", attn_block_k=64), "attn_block_k=64: on TPU"),
    (dict(platform="tpu_interpret", compute_dtype="bfloat16", norm_block_rows=8),
     "norm_block_rows=8: on TPU must be a multiple of 16 for bfloat16"),
    (dict(platform="gpu", attn_block_q=24), "attn_block_q=24: on GPU must be a power of two"),
    (dict(backend="triton"), "backend='triton'"),
    (dict(matmul_block_m=0), "matmul_block_m=0: must be a positive int"),
    (dict(delta_chunk=24), "delta_chunk=24: must be a power of two"),
    (dict(platform="gpu", delta_chunk=8), "delta_chunk=8: on GPU must be a power of two >= 16"),
    (dict(platform="tpu", delta_chunk=4), "delta_chunk=4: on TPU must be a multiple of 8"),
])
def test_invalid_contracts_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        NumericalContract(**changes)


def test_kernel_dim_pads_to_powers_of_two_on_gpu_only():
    assert NumericalContract(platform="gpu").kernel_dim(576) == 1024
    assert NumericalContract(platform="gpu").kernel_dim(3) == 4
    assert NumericalContract(platform="tpu").kernel_dim(576) == 576
    assert NumericalContract(platform="cpu").kernel_dim(3) == 3
    # Dot operands: Triton also wants at least 16.
    assert NumericalContract(platform="gpu").kernel_dot_dim(8) == 16
    assert NumericalContract(platform="gpu").kernel_dot_dim(24) == 32
    assert NumericalContract(platform="tpu").kernel_dot_dim(8) == 8


def test_pallas_for_an_absent_accelerator_raises():
    x = jnp.ones((2, 8))
    for platform in ("gpu", "tpu"):
        with pytest.raises(ValueError, match=f"resolves to '{platform}'.*default backend"):
            kernels.matmul(x, jnp.ones((8, 4)), contract=NumericalContract(platform=platform))


def test_execution_per_platform(monkeypatch):
    assert _grid.execution(NumericalContract(platform="cpu")).emulate_grid
    assert _grid.execution(NumericalContract(platform="cpu")).interpret is True
    tpu_interp = _grid.execution(NumericalContract(platform="tpu_interpret"))
    assert not tpu_interp.emulate_grid and tpu_interp.interpret
    monkeypatch.setattr(_grid, "_host_platform", lambda: "gpu")
    gpu = _grid.execution(NumericalContract(platform="gpu"))
    assert not gpu.emulate_grid and gpu.interpret is False
    with pytest.raises(ValueError, match="backend='pallas'"):
        _grid.execution(NumericalContract(backend="xla"))


def test_xla_backend_is_the_reference():
    rng = np.random.default_rng(0)
    contract = NumericalContract(backend="xla", compute_dtype="bfloat16")
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 16), (16, 8)))
    np.testing.assert_array_equal(
        kernels.matmul(x, w, contract=contract),
        reference.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
    logits, targets = jnp.asarray(rng.standard_normal((3, 10)), jnp.float32), jnp.arange(3)
    got = kernels.token_logprobs(logits, targets, contract=contract, return_entropy=False)
    np.testing.assert_array_equal(got.logp, reference.token_logprobs(logits, targets)[0])
    assert got.entropy is None
    # The xla backend differentiates with plain jax.grad.
    jax.grad(lambda x: kernels.rms_norm(x, jnp.ones(16), eps=1e-6, contract=contract).sum())(x)


def test_a_run_resolves_auto_to_the_platforms_tiles_and_keeps_explicit_fields():
    # The class default with platform "auto": every tile takes the platform's.
    for platform in ("cpu", "gpu", "tpu"):
        resolved = NumericalContract().resolved_for(platform)
        assert resolved == NumericalContract.for_platform(platform)
        assert resolved.platform == platform
    # A tile the user set stays; the others take the CPU's (matmul_block_m=32, attn_block_q=4,
    # attn_block_k=32 in _PLATFORM_TILES).
    mine = NumericalContract(attn_block_k=64, compute_dtype="bfloat16").resolved_for("cpu")
    assert (mine.attn_block_k, mine.attn_block_q, mine.matmul_block_m) == (64, 4, 32)
    assert mine.compute_dtype == "bfloat16"
    # A contract that names its platform (a run's recorded one) resolves to itself.
    assert mine.resolved_for("gpu") is mine
    # An explicit tile the platform refuses is one message naming it (Triton: >= 16).
    with pytest.raises(ValueError, match="NumericalContract.attn_block_q=4: on GPU"):
        NumericalContract(attn_block_q=4).resolved_for("gpu")


def test_row_tile_table_round_trips_and_is_checked():
    """matmul_row_tiles arrives as JSON lists and is kept as tuples (the contract is hashed);
    a bad entry is refused naming the field, the entry and what is allowed."""
    table = ((576, 1536, 0, 8, 64), (576, 49152, 1, 16))
    contract = NumericalContract(platform="cpu", matmul_block_m=32, matmul_row_tiles=table)
    again = NumericalContract.from_dict(json.loads(contract.to_json()))
    assert again == contract and hash(again) == hash(contract)
    assert again.matmul_row_tiles == table
    assert contract.row_tiles(576, 49152, True) == (16,)
    assert contract.row_tiles(576, 49152, False) == ()
    bad = {
        ((576, 1536, 0),): "at least one tile",
        ((576, 1536, 2, 8),): "w_transposed 0 or 1",
        ((576, 1536, 0, 12),): "tile 12 must be a power of two",
        ((576, 1536, 0, 2),): "tile 2 must be a power of two in [4, 256]",
        ((576, 1536, 0, 48),): "tile 48 must be a power of two",
        ((576, 1536, 0, 32),): "tile 32 must be below matmul_block_m=32 or a larger multiple",
        ((576, 1536, 0, 8), (576, 1536, 0, 16)): "two entries for K=576, N=1536",
    }
    for entries, message in bad.items():
        with pytest.raises(ValueError, match="NumericalContract.matmul_row_tiles") as err:
            NumericalContract(platform="cpu", matmul_block_m=32, matmul_row_tiles=entries)
        assert message in str(err.value)
    with pytest.raises(ValueError, match="emulated grid only; on gpu it must be empty"):
        NumericalContract.for_platform("gpu", matmul_row_tiles=table)
    # With platform "auto" block_m is not yet the platform's: a 16-row tile is checked against
    # the resolved contract's block_m (32 on a CPU) and holds there.
    auto = NumericalContract(matmul_row_tiles=((576, 1536, 0, 8, 16),))
    assert auto.resolved_for("cpu").row_tiles(576, 1536, False) == (8, 16)


def test_row_tile_table_from_the_command_line():
    """--set numerics.matmul_row_tiles takes a Python literal of the entries."""
    from jrl.pipeline.config import RunConfig
    from jrl.pipeline.config.tools import apply_overrides
    config = apply_overrides(RunConfig(), ["numerics.matmul_row_tiles=((576, 1536, 0, 8, 64),)"])
    assert config.numerics.matmul_row_tiles == ((576, 1536, 0, 8, 64),)
