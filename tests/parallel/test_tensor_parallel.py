"""Tensor parallelism on the 8 host CPU devices (jrl.parallel.tensor, jrl.kernels.row_parallel):
the row-parallel projections reduce contract.tensor_shards = V virtual shards in shard order,
so TP = 1, 2 and 4 give the one-device logprobs bit for bit, and a sampler on one device equals
a trainer on TP = 2 and 4, for a dense model and for Qwen3.5's hybrid (Gated DeltaNet and
gated attention); the xla backend's plain psum (the control) does not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import lora, transformer
from jrl.parallel.tensor import (TENSOR_AXIS, local_config, make_tensor_mesh,
                                 make_tensor_parallel_score_fn, qkv_column_order,
                                 tensor_param_specs, tensor_parallel_params)
from jrl.sampling import Sampler
from jrl.train import make_score_fn
from tests.sampling.helpers import (ARCHS, CONFIG, MAX_PROMPT_LEN, NUM_SLOTS, PREFILL_BUCKETS,
                                    PROMPTS, bits_equal, contract, layout, sampling)

SMALL = NumericalContract(platform="cpu", matmul_block_m=8, matmul_block_n=16,
                          matmul_block_k=16, norm_block_rows=8, logprob_block_rows=8)
# The tiny Llama with 8 query heads on 4 KV heads of 16 (hidden 32): the attention output's
# input dimension is 8 * 16 = 128 (V = 4 shards of 32), the MLP down projection's 64 (4 of
# 16). TP = 4 leaves each device 2 query heads (32 columns of wq), 1 KV head (16 of wk, wv) and
# 16 MLP columns: multiples of matmul_block_n = 16, so every device runs one-device tiles.
TP_CONFIG = CONFIG.replace(num_heads=8, num_kv_heads=4, head_dim=16)
# The tiny Qwen3.5 (Gated DeltaNet, gated attention, DeltaNet, gated attention) with 16 query
# heads of 16 on 8 KV heads, 4 DeltaNet key heads of 16 and 8 value heads of 8 (value head h
# reads key head h // 2). TP = 4 leaves each device 4 query heads (4 * 2 * 16 = 128 columns of
# the gated wq), 2 KV heads, 1 key head (16 columns each of w_qkv's q and k sections), 2 value
# heads (16 of its v section, 16 of w_z) and 16 MLP columns; the DeltaNet output's input
# dimension is 8 * 8 = 64 (V = 4 shards of 16).
HYBRID_TP_CONFIG = ARCHS["qwen35"].replace(
    num_heads=16, num_kv_heads=8, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=16, linear_value_head_dim=8)
MODELS = {"llama": TP_CONFIG, "qwen35": HYBRID_TP_CONFIG}
# One head per step of the CPU's attention and Gated DeltaNet kernels (check_emulated_heads):
# a device's steps are then one device's, whatever its share of the heads.
EXACT = contract().replace(tensor_shards=4, emulated_heads=1)
CONTROL = contract("xla").replace(tensor_shards=4)


@pytest.fixture(scope="module", autouse=True)
def needs_eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets them)")


def _sharded_matmul(tp: int, contract_: NumericalContract):
    """row_parallel_matmul inside shard_map over a degree-`tp` mesh: x [M, K] split by columns,
    w [K, N] by rows, y [M, N] whole on every device."""
    def layer(x, w):
        return kernels.row_parallel_matmul(x, w, contract=contract_, axis=TENSOR_AXIS)
    return jax.jit(jax.shard_map(layer, mesh=make_tensor_mesh(tp),
                                 in_specs=(PartitionSpec(None, TENSOR_AXIS),
                                           PartitionSpec(TENSOR_AXIS, None)),
                                 out_specs=PartitionSpec(), check_vma=False))


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


# ---------------------------------------------------------------------------------------------
# The layer


def test_row_parallel_matmul_by_hand():
    # V = 2 shards of K = 4: p_0 = x[:, :2] @ w[:2], p_1 = x[:, 2:] @ w[2:].
    #   p_0 = [[1, 2], [5, 6]]
    #   p_1 = [[3 * 1 + 4 * 2, 3 * 1 + 4 * -1], [7 * 1 + 8 * 2, 7 * 1 + 8 * -1]]
    #       = [[11, -1], [23, -1]]
    #   y   = p_0 + p_1 = [[12, 1], [28, 5]]
    x = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.float32)
    w = jnp.asarray([[1, 0], [0, 1], [1, 1], [2, -1]], jnp.float32)
    two = SMALL.replace(tensor_shards=2)
    want = np.asarray([[12, 1], [28, 5]], np.float32)
    np.testing.assert_array_equal(kernels.row_parallel_matmul(x, w, contract=two), want)
    for tp in (1, 2):
        np.testing.assert_array_equal(_sharded_matmul(tp, two)(x, w), want)


def test_the_partials_are_summed_in_shard_order_for_every_degree():
    # V = 4 shards of one column each: p = [2^24, 1, 1, -2^24]. In float32, shard order:
    #   2^24 + 1 = 16777217 is halfway between 2^24 and 2^24 + 2 -> rounds to even, 2^24;
    #   2^24 + 1 -> 2^24 again; 2^24 - 2^24 = 0.
    # (The exact sum is 2.) TP = 1, 2 and 4 sum the same four partials in the same order.
    # The xla control at TP = 2 sums the devices' local dots instead:
    #   device 0: 2^24 + 1 -> 2^24;  device 1: 1 - 2^24 = -16777215 (exact);  psum = 1.
    x = jnp.ones((1, 4), jnp.float32)
    w = jnp.asarray([[2.0**24], [1.0], [1.0], [-2.0**24]], jnp.float32)
    four = SMALL.replace(tensor_shards=4)
    assert float(kernels.row_parallel_matmul(x, w, contract=four)[0, 0]) == 0.0
    for tp in (1, 2, 4):
        assert float(_sharded_matmul(tp, four)(x, w)[0, 0]) == 0.0, tp
    control = four.replace(backend="xla")
    assert float(_sharded_matmul(2, control)(x, w)[0, 0]) == 1.0


def test_one_shard_is_the_plain_matmul_and_k_tiles_of_a_shard_are_the_shard_order():
    x, w = _random((2, 5, 64), 0), _random((64, 24), 1)
    plain = kernels.matmul(x, w, contract=SMALL)
    # tensor_shards = 1 without an axis: project_rows is `project`, kernels.matmul itself.
    assert bits_equal(lora.project_rows(x, {"wo": w}, "wo", config=None, contract=SMALL), plain)
    assert bits_equal(kernels.row_parallel_matmul(x, w, contract=SMALL), plain)
    # The kernel accumulates its K tiles of matmul_block_k = 16 in order in float32: with
    # V = 64 / 16 = 4 shards of 16 its own order is the shard order (an independent reference).
    four = SMALL.replace(tensor_shards=4)
    got = lora.project_rows(x, {"wo": w}, "wo", config=None, contract=four)
    assert bits_equal(got, plain)
    # ... and one device equals TP = 2 and 4 on the same shards.
    for tp in (2, 4):
        assert bits_equal(_sharded_matmul(tp, four)(x.reshape(10, 64), w), got.reshape(10, 24))


def test_the_one_device_gradient_is_the_plain_matmuls():
    """Integer-valued inputs (|x|, |w|, |dy| <= 3, K = 8): every product and sum is an integer
    far below 2^24, exact in float32 in any order, so the per-shard backward equals jax.grad
    of a plain matmul exactly."""
    rng = np.random.default_rng(3)
    x, w, dy = (jnp.asarray(rng.integers(-3, 4, size=s), jnp.float32)
                for s in ((6, 8), (8, 5), (6, 5)))
    four = SMALL.replace(tensor_shards=4)

    def loss(matmul, x, w):
        return jnp.sum(matmul(x, w) * dy)

    got = jax.grad(functools.partial(loss, functools.partial(
        kernels.row_parallel_matmul, contract=four)), argnums=(0, 1))(x, w)
    want = jax.grad(functools.partial(loss, functools.partial(
        jnp.matmul, precision=jax.lax.Precision.HIGHEST)), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], np.asarray(dy) @ np.asarray(w).T)    # a third check
    assert float(jnp.abs(got[1]).max()) > 0


def test_the_gradient_across_devices_is_refused():
    x, w = _random((4, 64), 0), _random((64, 8), 1)
    four = SMALL.replace(tensor_shards=4)

    def grads(x, w):
        return jax.grad(lambda x, w: jnp.sum(kernels.row_parallel_matmul(
            x, w, contract=four, axis=TENSOR_AXIS)), argnums=(0, 1))(x, w)
    sharded = jax.shard_map(grads, mesh=make_tensor_mesh(2),
                            in_specs=(PartitionSpec(None, TENSOR_AXIS),
                                      PartitionSpec(TENSOR_AXIS, None)),
                            out_specs=(PartitionSpec(None, TENSOR_AXIS),
                                       PartitionSpec(TENSOR_AXIS, None)), check_vma=False)
    with pytest.raises(NotImplementedError,
                       match="gradients under tensor parallelism are not implemented"):
        jax.jit(sharded)(x, w)


# ---------------------------------------------------------------------------------------------
# The model: one-device sampler against the TP trainer


@functools.lru_cache(maxsize=None)
def _params(arch: str = "llama"):
    """helpers.model_params' recipe (init x 15: peaked next-token distributions) on
    MODELS[arch]."""
    params = transformer.init_params(MODELS[arch], jax.random.key(0))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, params)


@functools.lru_cache(maxsize=None)
def _samples(arch: str = "llama"):
    """PROMPTS sampled on one device (4 slots, tensor_shards = 4), as helpers.sampler does."""
    s = Sampler(MODELS[arch], EXACT, sampling(), num_slots=NUM_SLOTS,
                max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4, return_entropy=True,
                prefill_buckets=PREFILL_BUCKETS)
    return s.generate(_params(arch), PROMPTS)


@functools.lru_cache(maxsize=None)
def _batch(arch: str = "llama"):
    """Every sample at one row, reverse order, 30 positions: a layout unlike the sampler's."""
    samples = _samples(arch)
    lay = layout(samples, list(range(len(samples)))[::-1], len(samples), 30)
    return lay, (jnp.asarray(lay.tokens), jnp.asarray(lay.mask), jnp.asarray(lay.floor))


@functools.lru_cache(maxsize=None)
def _tp_scores(tp: int, contract_: NumericalContract, arch: str = "llama"):
    score = jax.jit(make_tensor_parallel_score_fn(MODELS[arch], contract_, make_tensor_mesh(tp)))
    return score(_params(arch), *_batch(arch)[1])


@functools.lru_cache(maxsize=None)
def _one_device_scores(contract_: NumericalContract, arch: str = "llama"):
    return jax.jit(make_score_fn(MODELS[arch], contract_))(_params(arch), *_batch(arch)[1])


def test_tp_1_2_4_equal_one_device_bitwise():
    specs = tensor_param_specs(TP_CONFIG, make_tensor_mesh(4))
    assert specs["layers"]["wo"] == PartitionSpec(None, TENSOR_AXIS, None)
    assert specs["layers"]["w_down"] == PartitionSpec(None, TENSOR_AXIS, None)
    single = _one_device_scores(EXACT)
    for tp in (1, 2, 4):
        scores = _tp_scores(tp, EXACT)
        assert bits_equal(scores.logp, single.logp), tp
        assert bits_equal(scores.entropy, single.entropy), tp
    mask = np.asarray(_batch()[1][1])[:, 1:]
    assert float(np.asarray(single.entropy)[:, 1:][mask].min()) > 0   # real distributions
    assert float(np.asarray(single.logp)[:, 1:][mask].min()) < -0.01


def test_sampler_on_one_device_equals_the_trainer_on_tp_2_and_4():
    """p_b of the one-device sampler (decode steps of 4 slots) equals p_o of the TP trainer
    (one batch of 12 rows in reverse order), bit for bit, at TP = 2 and 4."""
    samples = _samples()
    lay = _batch()[0]
    assert len(samples) == 12 and sum(s.length for s in samples) > 60
    for tp in (2, 4):
        logp = np.asarray(_tp_scores(tp, EXACT).logp)
        for i, s in enumerate(samples):
            row, p, n = lay.rows[i], s.prompt_tokens.size, s.length
            assert bits_equal(logp[row, p:p + n], s.behavior_logp), (tp, i)


def test_the_xla_control_at_tp_2_is_not_one_device():
    """The xla backend runs plain TP (a psum of two local products): the same model and batch
    give other bits than one device (measured: a max |d logp| of 2.2e-5 here)."""
    single = np.asarray(_one_device_scores(CONTROL).logp)
    control = np.asarray(_tp_scores(2, CONTROL).logp)
    difference = float(np.max(np.abs(control - single)))
    assert 0 < difference < 1e-3


# ---------------------------------------------------------------------------------------------
# Qwen3.5's hybrid: Gated DeltaNet and gated attention


def test_the_deltanet_qkv_columns_are_permuted_into_per_device_blocks():
    # A toy DeltaNet: 2 key heads of 1 (q = columns 0, 1; k = 2, 3) and 4 value heads of 1
    # (v = 4 .. 7). At T = 2 device 0 holds key head 0 (q 0, k 2) and value heads 0, 1 (v 4,
    # 5); device 1 key head 1 (q 1, k 3) and value heads 2, 3 (v 6, 7).
    toy = HYBRID_TP_CONFIG.replace(linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=1, linear_value_head_dim=1)
    np.testing.assert_array_equal(qkv_column_order(toy, 2), [0, 2, 4, 5, 1, 3, 6, 7])
    np.testing.assert_array_equal(qkv_column_order(toy, 1), np.arange(8))
    params = _params("qwen35")
    permuted = tensor_parallel_params(params, HYBRID_TP_CONFIG, 4)
    order = qkv_column_order(HYBRID_TP_CONFIG, 4)
    for name in ("w_qkv", "conv"):
        np.testing.assert_array_equal(permuted["layers_deltanet"][name],
                                      np.asarray(params["layers_deltanet"][name])[..., order])
    assert permuted["layers"] is params["layers"]
    assert tensor_parallel_params(params, HYBRID_TP_CONFIG, 1) is params
    specs = tensor_param_specs(HYBRID_TP_CONFIG, make_tensor_mesh(4))["layers_deltanet"]
    for name in ("w_qkv", "conv", "w_z"):
        assert specs[name] == PartitionSpec(None, None, TENSOR_AXIS), name
    assert specs["w_out"] == PartitionSpec(None, TENSOR_AXIS, None)
    for name in ("w_a", "w_b", "dt_bias", "A_log", "delta_norm"):
        assert TENSOR_AXIS not in specs[name], name
    shard = local_config(HYBRID_TP_CONFIG, 4)
    assert (shard.linear_num_key_heads, shard.linear_num_value_heads, shard.num_heads,
            shard.num_kv_heads) == (1, 2, 4, 2)


def test_hybrid_tp_1_2_4_equal_one_device_bitwise():
    """Gated DeltaNet and gated attention split by heads: TP = 1, 2, 4 score the one-device
    logprobs and entropies bit for bit."""
    single = _one_device_scores(EXACT, "qwen35")
    for tp in (1, 2, 4):
        scores = _tp_scores(tp, EXACT, "qwen35")
        assert bits_equal(scores.logp, single.logp), tp
        assert bits_equal(scores.entropy, single.entropy), tp
    mask = np.asarray(_batch("qwen35")[1][1])[:, 1:]
    assert float(np.asarray(single.entropy)[:, 1:][mask].min()) > 0
    assert float(np.asarray(single.logp)[:, 1:][mask].min()) < -0.01


def test_hybrid_sampler_on_one_device_equals_the_trainer_on_tp_2_and_4():
    """p_b of the one-device sampler (prefill, then decode steps of 4 slots continuing each
    DeltaNet layer's cached state) equals p_o of the TP trainer (one full-sequence batch in
    reverse row order), bit for bit."""
    samples = _samples("qwen35")
    lay = _batch("qwen35")[0]
    assert len(samples) == 12 and sum(s.length for s in samples) > 60
    for tp in (2, 4):
        logp = np.asarray(_tp_scores(tp, EXACT, "qwen35").logp)
        for i, s in enumerate(samples):
            row, p, n = lay.rows[i], s.prompt_tokens.size, s.length
            assert bits_equal(logp[row, p:p + n], s.behavior_logp), (tp, i)


def test_the_hybrid_xla_control_at_tp_2_is_not_one_device():
    """Plain TP (psums) on the hybrid: other bits than one device (measured: a max |d logp| of
    5.7e-6 here)."""
    single = np.asarray(_one_device_scores(CONTROL, "qwen35").logp)
    control = np.asarray(_tp_scores(2, CONTROL, "qwen35").logp)
    difference = float(np.max(np.abs(control - single)))
    assert 0 < difference < 1e-3


def test_the_hybrid_column_tiles_cover_the_deltanet_sections():
    with pytest.raises(ValueError, match=r"matmul_block_n=32: under tensor parallelism of "
                                         r"degree 4 .* \(w_gate 16, w_qkv q, k 16, w_qkv v 16, "
                                         r"w_up 16, w_z 16, wk 32, wq 128, wv 32\)"):
        make_tensor_parallel_score_fn(HYBRID_TP_CONFIG, EXACT.replace(matmul_block_n=32),
                                      make_tensor_mesh(4))
    with pytest.raises(ValueError, match="degree 8: linear_num_key_heads=4 does not split"):
        local_config(HYBRID_TP_CONFIG, 8)


# ---------------------------------------------------------------------------------------------
# What is refused


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen35_moe", "llama_lora"])
def test_local_config_refuses_moe_and_lora(arch):
    with pytest.raises(ValueError, match=f"{ARCHS[arch].model_type} has MoE layers or LoRA"):
        local_config(ARCHS[arch], 2)


def test_heads_and_columns_must_split_over_the_degree():
    with pytest.raises(ValueError, match="degree 3: num_heads=8 does not split"):
        local_config(TP_CONFIG, 3)
    with pytest.raises(ValueError, match="degree 8: num_kv_heads=4 does not split"):
        tensor_param_specs(TP_CONFIG, make_tensor_mesh(8))
    with pytest.raises(ValueError, match="intermediate_size=36 does not split"):
        local_config(TP_CONFIG.replace(num_kv_heads=8, intermediate_size=36), 8)
    shard = local_config(TP_CONFIG, 4)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (2, 1, 16)
    assert shard.head_dim == 16


def test_tensor_shards_must_be_a_multiple_of_the_degree_and_divide_k():
    two = EXACT.replace(tensor_shards=2)
    with pytest.raises(ValueError, match="tensor_shards=2: must be a multiple of the mesh's "
                                         "tensor size 4"):
        make_tensor_parallel_score_fn(TP_CONFIG, two, make_tensor_mesh(4))
    x, w = _random((4, 64), 0), _random((64, 8), 1)
    with pytest.raises(ValueError, match="tensor_shards=2: must be a multiple of the "
                                         "tensor-parallel degree 4"):
        _sharded_matmul(4, SMALL.replace(tensor_shards=2))(x, w)
    with pytest.raises(ValueError, match="tensor_shards=4: must divide the row-parallel "
                                         "projection's input dimension 6"):
        kernels.row_parallel_matmul(x[:, :6], w[:6], contract=SMALL.replace(tensor_shards=4))
    with pytest.raises(ValueError, match="tensor_shards=4: must divide the row-parallel "
                                         "projection's input dimension 6"):
        kernels.row_parallel_matmul(x[:, :6], w[:6],
                                    contract=SMALL.replace(tensor_shards=4, backend="xla"))
    with pytest.raises(ValueError, match=r"expected x \[..., K\] and w \[K, N\]"):
        kernels.row_parallel_matmul(x, w[:6], contract=SMALL.replace(tensor_shards=4))


def test_every_device_must_run_the_one_device_column_tiles():
    # TP = 4: wk and wv keep 4 * 16 / 4 = 16 columns per device, which 32 does not divide.
    with pytest.raises(ValueError, match=r"matmul_block_n=32: under tensor parallelism of "
                                         r"degree 4 it must divide each device's columns of "
                                         r"the column-parallel weights \(w_gate 16, w_up 16, "
                                         r"wk 16, wq 32, wv 16\)"):
        make_tensor_parallel_score_fn(TP_CONFIG, EXACT.replace(matmul_block_n=32),
                                      make_tensor_mesh(4))
    # The CPU's default tile is the whole operand (2^18 columns): refused from TP = 2 on, and
    # fine at TP = 1 (no columns split) and on the xla backend (the control).
    whole = NumericalContract(platform="cpu", tensor_shards=4)
    with pytest.raises(ValueError, match="matmul_block_n=262144: under tensor parallelism of "
                                         "degree 2"):
        make_tensor_parallel_score_fn(TP_CONFIG, whole, make_tensor_mesh(2))
    make_tensor_parallel_score_fn(TP_CONFIG, whole, make_tensor_mesh(1))
    make_tensor_parallel_score_fn(TP_CONFIG, whole.replace(backend="xla"), make_tensor_mesh(2))
    make_tensor_parallel_score_fn(TP_CONFIG, EXACT.replace(matmul_block_n=32),
                                  make_tensor_mesh(2))


def test_every_device_must_run_the_one_device_attention_steps():
    """On the CPU the attention and Gated DeltaNet kernels batch a step's dots over its heads:
    with one head per step (emulated_heads=1) a device's slice of the heads runs the same dots
    as those heads in a one-device call, so its output is theirs bit for bit; with every head
    in one step (0, the default) TP is refused, naming the field."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(3, 12, h, 16)), jnp.float32) for h in (8, 4, 4))
    positions = jnp.broadcast_to(jnp.arange(12), (3, 12))
    per_head = SMALL.replace(emulated_heads=1)

    def attend(q, k, v):
        return kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                 kv_valid=positions >= 0, contract=per_head)
    whole = attend(q, k, v)
    # Device 1 of TP = 2: query heads 4..7, which read KV heads 2 and 3.
    assert bits_equal(attend(q[:, :, 4:], k[:, :, 2:], v[:, :, 2:]), whole[:, :, 4:])
    with pytest.raises(ValueError, match=r"emulated_heads=0: under tensor parallelism of "
                                         r"degree 2 on the CPU's emulated grid it must divide "
                                         r"each device's 2 KV heads"):
        make_tensor_parallel_score_fn(TP_CONFIG, EXACT.replace(emulated_heads=0),
                                      make_tensor_mesh(2))
    # Gated DeltaNet: 2 key heads, 4 value heads (value head h reads key head h // 2); device 1
    # of TP = 2 holds key head 1 and value heads 2 and 3.
    qk = [jnp.asarray(rng.normal(size=(3, 20, 2, 16)), jnp.float32) for _ in range(2)]
    values = jnp.asarray(rng.normal(size=(3, 20, 4, 8)), jnp.float32)
    decay = -jnp.abs(jnp.asarray(rng.normal(size=(3, 20, 4)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(3, 20, 4)), jnp.float32))

    def delta(q, k, v, g, b):
        return kernels.gated_delta_rule(
            q, k, v, g, b, valid=jnp.ones((3, 20), bool), state_chunk=jnp.ones((3,), jnp.int32),
            initial_state=jnp.zeros((3, v.shape[2], 16, 8), jnp.float32),
            contract=per_head.replace(delta_chunk=8))
    whole_delta = delta(*qk, values, decay, beta)
    part = delta(qk[0][:, :, 1:], qk[1][:, :, 1:], values[:, :, 2:], decay[:, :, 2:],
                 beta[:, :, 2:])
    assert bits_equal(part.out, whole_delta.out[:, :, 2:])
    assert bits_equal(part.state, whole_delta.state[:, 2:])
    with pytest.raises(ValueError, match="emulated_heads=3: must divide the layer's 4 KV"):
        kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                          kv_valid=positions >= 0, contract=SMALL.replace(emulated_heads=3))
    with pytest.raises(ValueError, match="emulated_heads=-1: must be 0"):
        SMALL.replace(emulated_heads=-1)
    make_tensor_parallel_score_fn(TP_CONFIG, EXACT.replace(emulated_heads=2),
                                  make_tensor_mesh(2))


def test_the_contract_field_is_validated():
    with pytest.raises(ValueError, match="NumericalContract.tensor_shards=0: must be a "
                                         "positive int"):
        NumericalContract(tensor_shards=0)
    with pytest.raises(ValueError, match="tensor_shards=2 with matmul_dtype='float8_e4m3fn': "
                                         "the row-parallel virtual shards run compute-dtype"):
        NumericalContract(tensor_shards=2, matmul_dtype="float8_e4m3fn")
    assert NumericalContract(tensor_shards=1, matmul_dtype="float8_e4m3fn").tensor_shards == 1


def test_adapters_and_quantised_bases_are_refused_on_shards():
    x, w = _random((4, 64), 0), _random((64, 8), 1)
    layer = {"wo": w, "wo_lora_a": _random((64, 2), 2), "wo_lora_b": _random((2, 8), 3)}
    with pytest.raises(ValueError, match="tensor_shards=4: the row-parallel 'wo' runs on "
                                         "plain weights"):
        lora.project_rows(x, layer, "wo", config=None, contract=SMALL.replace(tensor_shards=4))
    with pytest.raises(ValueError, match="LoRA adapters and quantised bases are not supported"):
        lora.project_rows(x, {"wo": kernels.quantize(w, "int8")}, "wo", config=None,
                          contract=SMALL.replace(tensor_shards=4))


def test_the_mesh_and_the_rows_are_checked():
    with pytest.raises(ValueError, match="a tensor-parallel mesh: tensor=0 must be a positive int"):
        make_tensor_mesh(0)
    with pytest.raises(ValueError, match="data \\* tensor = 16 devices, but only 8"):
        make_tensor_mesh(8, data=2)
    score = make_tensor_parallel_score_fn(TP_CONFIG, EXACT, make_tensor_mesh(2, data=2))
    tokens = jnp.zeros((3, 8), jnp.int32)
    with pytest.raises(ValueError, match="3 rows do not split over data = 2 devices"):
        score(_params(), tokens, tokens > -1, jnp.zeros((3, 8), jnp.float32))
