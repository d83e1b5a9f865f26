"""Shared setup of the sampling tests: one tiny model, a few sampler specs, the train recompute.

Compilations dominate the run time (Pallas interpret mode), so every helper is cached: a sampler
spec (config, contract, sampling params, slot shapes) compiles once per process and is reused by
every test that names it, and the train forward compiles once per (contract, temperature, shape).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.models import lora, transformer
from jrl.models.config import LoraConfig, ModelConfig, RopeScaling
from jrl.sampling import Sample, Sampler, SamplingParams
from jrl.sampling import prefix as prefix_programs
from jrl.sampling import slots as slot_programs

# Tiny Llama: 2 layers, GQA (2 query heads on 1 kv head), vocab 32.
CONFIG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=16)
# The same tiny sizes in the other families jrl runs (ARCHS[arch]):
# - qwen35: Qwen3.5's hybrid: Gated DeltaNet, gated attention, DeltaNet, gated attention (a
#   period of 2 scanned twice), value heads (2) != key heads (1), dk 8 != dv 16, partial rotary;
# - qwen3_moe: Qwen3-MoE, 8 experts top-2, layer 0 dense (mlp_only_layers);
# - qwen35_moe: the hybrid with MoE blocks and the shared expert.
_HYBRID = dict(layer_types=("linear_attention", "full_attention") * 2, num_layers=4,
               linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=16, partial_rotary_factor=0.5, attn_output_gate=True,
               norm_offset=1.0, qk_norm=True)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
ARCHS = {
    "llama": CONFIG,
    "qwen35": CONFIG.replace(model_type="qwen3_5_text", **_HYBRID),
    "qwen3_moe": CONFIG.replace(model_type="qwen3_moe", qk_norm=True, mlp_only_layers=(0,),
                                norm_topk_prob=False, **_MOE),
    "qwen35_moe": CONFIG.replace(model_type="qwen3_5_moe_text", **_HYBRID, **_MOE,
                                 shared_expert_intermediate_size=16),
}
# LoRA (jrl.models.lora) on the tiny Llama: rank-4 adapters on an attention input, the value
# path and the MLP output (every projection goes through the same jrl.models.lora.project, and
# each adapted one adds four kernels to compile); "llama_qlora" stores the frozen base int8.
# NF4 needs input dims and matmul_block_k that are multiples of 64 (this model's dims are 32):
# "llama64_qlora_nf4" adapts a twice-as-wide Llama (hidden 64, 2 heads of 32, MLP 128).
ARCHS["llama64"] = CONFIG.replace(hidden_size=64, intermediate_size=128, head_dim=32)
# Qwen2 (q/k/v biases) and dense Qwen3 (per-head q/k norm) at the tiny Llama's sizes.
ARCHS["qwen2"] = CONFIG.replace(model_type="qwen2", attention_bias=True)
ARCHS["qwen3"] = CONFIG.replace(model_type="qwen3", qk_norm=True)
# Llama 3.x: the tiny Llama with Llama 3's RoPE frequency scaling, all three bands present:
# theta 1e4, head_dim 16 -> wavelengths 2 pi / f_i = 6.3, 19.9, 62.8, ...; with L = 32 the
# first is kept (< 32 / 4), the second blended (<= 32 / 1), the rest interpolated.
ARCHS["llama3"] = CONFIG.replace(rope_scaling=RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32))
_ADAPTERS = dict(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
# (base arch, base weights' seed, adapters). The wide base uses seed 6: seed 0's samples there
# seldom stop early, and the refill checks need slots that free up while others decode.
LORA_ARCHS = {"llama_lora": ("llama", 0, LoraConfig(**_ADAPTERS)),
              "llama_qlora": ("llama", 0, LoraConfig(**_ADAPTERS, quantize="int8")),
              "llama64_qlora_nf4": ("llama64", 6, LoraConfig(**_ADAPTERS, quantize="nf4"))}
ARCHS.update({name: ARCHS[base].replace(lora=adapters)
              for name, (base, _, adapters) in LORA_ARCHS.items()})
# Tile changes an arch needs (every other tile as TILES).
ARCH_TILES = {"llama64_qlora_nf4": dict(matmul_block_k=64)}
STOP = 1
MAX_PROMPT_LEN = 8
MAX_NEW_TOKENS = 16
NUM_SLOTS = 4
GROUP_SIZE = 3
# Four prompts of different lengths (1 .. MAX_PROMPT_LEN); ids are not 0..3 on purpose.
PROMPTS = ((10, (5, 9, 3)), (11, (2, 7, 7, 30, 12, 4, 8, 21)), (12, (6,)), (13, (3, 14, 15, 9, 2)))
# Small tiles, so that every kernel runs several row tiles, K tiles, KV blocks and vocab chunks
# in the train forward, and the decode batch (4 rows) and the train batch (12+ rows of 24-30
# positions) are tiled differently. On a GPU these tests run the Triton kernels, whose tiles
# are powers of two >= 16 (NumericalContract.validate): there the KV tile and the delta chunk
# are 16, which still gives 2 KV blocks and 2 chunks over a train row.
ON_GPU = jax.default_backend() == "gpu"
TILES = dict(matmul_block_m=16, matmul_block_n=16, matmul_block_k=16, attn_block_q=16,
             attn_block_k=16 if ON_GPU else 8, norm_block_rows=16, logprob_block_rows=16,
             vocab_chunk=16, delta_chunk=16 if ON_GPU else 8)


def contract(backend: str = "pallas", dtype: str = "float32", arch: str = "llama",
             kv_dtype: str = "compute", matmul_dtype: str = "compute") -> NumericalContract:
    return NumericalContract(backend=backend, compute_dtype=dtype, kv_dtype=kv_dtype,
                             matmul_dtype=matmul_dtype,
                             **{**TILES, **ARCH_TILES.get(arch, {})})


@functools.lru_cache(maxsize=None)
def model_params(seed: int = 0, arch: str = "llama"):
    """Random weights scaled up x15: with the default init (std 0.02) a tiny model's next-token
    distribution is nearly uniform; scaled, it is peaked and position dependent, so samples are
    diverse but not uniform noise. (Gated DeltaNet's decay parameters keep their init.)
    A LoRA arch: the llama weights with adapters attached and B drawn from N(0, 0.5) (B = 0,
    the init, would leave the adapters out of every product that matters)."""
    if arch in LORA_ARCHS:
        base_arch, base_seed, adapters = LORA_ARCHS[arch]
        config, params = lora.attach(ARCHS[base_arch], model_params(seed + base_seed, base_arch),
                                     adapters)
        assert config == ARCHS[arch]
        adapters, base = lora.split(params)
        leaves, treedef = jax.tree.flatten(adapters)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        adapters = treedef.unflatten([
            0.5 * jax.random.normal(k, x.shape, x.dtype) if path.endswith("_lora_b") else x
            for k, x, path in zip(keys, leaves, _leaf_names(adapters))])
        return lora.merge(adapters, base)
    params = transformer.init_params(ARCHS[arch], jax.random.key(seed))
    params = jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, params)
    if ARCHS[arch].attention_bias:
        # Biases start at 0, which would leave them out of every sum: draw them too.
        layers = dict(params["layers"])
        for i, name in enumerate(("bq", "bk", "bv")):
            layers[name] = jax.random.normal(jax.random.key(seed + 100 + i), layers[name].shape,
                                             layers[name].dtype)
        params = {**params, "layers": layers}
    return params


def _leaf_names(tree) -> list[str]:
    """The last key of every leaf's path, in jax.tree.flatten order."""
    return [str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def sampling(**changes) -> SamplingParams:
    base = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_tokens=(STOP,),
                          group_size=GROUP_SIZE, seed=7)
    return base.replace(**changes)


# One prefill program per sampler spec (Sampler.prefill_buckets="one"): the suite compiles a
# third of the prefill programs it would with power-of-two buckets, and a row's bits do not
# depend on its batch. test_engine's precompile test, test_cpu_tiles and
# test_one_prefill_bucket_gives_the_same_samples keep the power-of-two buckets under test.
PREFILL_BUCKETS = "one"


def sampler(backend="pallas", dtype="float32", *, num_slots=NUM_SLOTS, steps_per_call=4,
            recompute_kv_on_swap=False, continuous_batching=True, arch: str = "llama",
            share_prefill=False, prefix_pool_rows=None, speculative=None,
            prefill_buckets=PREFILL_BUCKETS, kv_dtype="compute", matmul_dtype="compute",
            **sampling_changes) -> Sampler:
    """A Sampler; equal specs share their compiled programs, so building one is free."""
    return Sampler(ARCHS[arch], contract(backend, dtype, arch, kv_dtype, matmul_dtype),
                   sampling(**sampling_changes),
                   num_slots=num_slots, max_prompt_len=MAX_PROMPT_LEN,
                   steps_per_call=steps_per_call, return_entropy=True,
                   recompute_kv_on_swap=recompute_kv_on_swap,
                   continuous_batching=continuous_batching, share_prefill=share_prefill,
                   prefix_pool_rows=prefix_pool_rows, speculative=speculative,
                   prefill_buckets=prefill_buckets)


class Case(NamedTuple):
    backend: str = "pallas"
    dtype: str = "float32"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    arch: str = "llama"
    kv_dtype: str = "compute"      # "float8_e4m3fn": an FP8 KV cache (jrl.kernels.fp8)
    matmul_dtype: str = "compute"  # "float8_e4m3fn": W8A8 matmuls (jrl.kernels.fp8)

    def contract(self) -> NumericalContract:
        return contract(self.backend, self.dtype, self.arch, self.kv_dtype, self.matmul_dtype)


class Run(NamedTuple):
    samples: list
    stats: dict


@functools.lru_cache(maxsize=None)
def run(case: Case) -> Run:
    """The samples of PROMPTS under `case` (cached: several tests inspect the same run)."""
    s = sampler(case.backend, case.dtype, temperature=case.temperature, top_p=case.top_p,
                top_k=case.top_k, arch=case.arch, kv_dtype=case.kv_dtype,
                matmul_dtype=case.matmul_dtype)
    samples = s.generate(model_params(0, case.arch), PROMPTS)
    return Run(samples, dict(s.last_stats))


# ---------------------------------------------------------------------------------------------
# The train-side recompute


@functools.partial(jax.jit, static_argnames=("config", "contract", "temperature"))
def _train_logprobs(params, tokens, mask, floor, *, config, contract, temperature):
    return transformer.sequence_logprobs(params, config, tokens, contract=contract, mask=mask,
                                         temperature=temperature, logit_floor=floor)


class Layout(NamedTuple):
    """A right-padded train batch. tokens/mask/floor [B, T]; rows[i] = the batch row of sample
    i (or -1 when the sample is not in this batch)."""

    tokens: np.ndarray
    mask: np.ndarray
    floor: np.ndarray
    rows: list


def layout(samples: Sequence[Sample], order: Sequence[int], batch: int, length: int) -> Layout:
    """Samples `order[j]` at row j of a [batch, length] batch: prompt + response, right padded.
    Rows beyond len(order) are filler (a copy of the first sample, masked out entirely)."""
    tokens = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), bool)
    floor = np.full((batch, length), -np.inf, np.float32)
    rows = [-1] * len(samples)
    for row, i in enumerate(order):
        s = samples[i]
        p, n = s.prompt_tokens.size, s.length
        tokens[row, :p] = s.prompt_tokens
        tokens[row, p:p + n] = s.tokens
        mask[row, :p + n] = True
        floor[row, p:p + n] = s.logit_floor
        rows[i] = row
    for row in range(len(order), batch):
        tokens[row] = tokens[0]  # filler rows: arbitrary real tokens, mask all False
    return Layout(tokens, mask, floor, rows)


def train_logprobs(params, samples: Sequence[Sample], contract: NumericalContract,
                   temperature: float, *, order: Sequence[int], batch: int, length: int,
                   return_entropy: bool = False, arch: str = "llama"):
    """Per-sample response logprobs (and entropies) as the train forward computes them from a
    batch laid out by `layout`. Returns a list (one [N] array per sample in `order`, None for
    the others)."""
    lay = layout(samples, order, batch, length)
    logp, entropy = _train_logprobs(params, jnp.asarray(lay.tokens), jnp.asarray(lay.mask),
                                    jnp.asarray(lay.floor), config=ARCHS[arch],
                                    contract=contract, temperature=float(temperature))
    logp, entropy = np.asarray(logp), np.asarray(entropy)
    out_logp, out_entropy = [], []
    for i, s in enumerate(samples):
        row = lay.rows[i]
        if row < 0:
            out_logp.append(None)
            out_entropy.append(None)
            continue
        p, n = s.prompt_tokens.size, s.length
        out_logp.append(logp[row, p:p + n])
        out_entropy.append(entropy[row, p:p + n])
    return (out_logp, out_entropy) if return_entropy else out_logp


def recompute_two_layouts(params, samples, contract, temperature, arch: str = "llama"):
    """p_o of every sample from two train batches laid out unlike the sampler's slots:
    (1) all samples in reverse order, one batch, padded to 30 positions;
    (2) a shuffled order in micro-batches of 5 rows (the last one partly filler), padded to 24.
    Returns (logp_1, logp_2): lists of [N] arrays in sample order."""
    count = len(samples)
    first = train_logprobs(params, samples, contract, temperature, order=range(count)[::-1],
                           batch=count, length=30, arch=arch)
    shuffled = np.random.default_rng(0).permutation(count)
    second = [None] * count
    for start in range(0, count, 5):
        part = shuffled[start:start + 5]
        got = train_logprobs(params, samples, contract, temperature, order=part, batch=5,
                             length=MAX_PROMPT_LEN + MAX_NEW_TOKENS, arch=arch)
        for i in part:
            second[i] = got[i]
    return first, second


def max_abs_diff(a_list, b_list) -> float:
    return max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
               for a, b in zip(a_list, b_list))


def bits_equal(a, b) -> bool:
    """Bitwise equality of float arrays (-0.0 != 0.0, NaN payloads compared)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all(a.view(np.uint32) == b.view(np.uint32)))


def response_batch(samples, per_sample):
    """Stack per-sample [N] arrays into a right-padded [B, M] float32 batch + mask [B, M]."""
    out = np.zeros((len(samples), MAX_NEW_TOKENS), np.float32)
    mask = np.zeros((len(samples), MAX_NEW_TOKENS), bool)
    for i, (s, x) in enumerate(zip(samples, per_sample)):
        out[i, :s.length] = x
        mask[i, :s.length] = True
    return out, mask


def assert_same_samples(a_list, b_list):
    """Two runs gave the same samples, bit for bit: tokens, p_b, floors, entropies, versions,
    finish reasons and MoE routes."""
    assert [(a.prompt_id, a.sample_index) for a in a_list] == \
           [(b.prompt_id, b.sample_index) for b in b_list]
    for a, b in zip(a_list, b_list):
        assert np.array_equal(a.tokens, b.tokens), (a.prompt_id, a.sample_index)
        assert bits_equal(a.behavior_logp, b.behavior_logp)
        assert bits_equal(a.logit_floor, b.logit_floor)
        assert bits_equal(a.entropy, b.entropy)
        assert np.array_equal(a.versions, b.versions)
        assert a.finish_reason == b.finish_reason
        for name in ("experts", "prompt_experts"):     # MoE routes (None for dense models)
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or np.array_equal(x, y), name


def poll_after(calls_before_swap: int, new_params):
    """A poll_weights that delivers (new_params, version 1) on its calls_before_swap-th call:
    a weight swap landing between two device calls."""
    calls = [0]

    def poll():
        calls[0] += 1
        return (new_params, 1) if calls[0] == calls_before_swap else None
    return poll


def seat_prompts(s: Sampler, params, *, shared: bool = False):
    """s's slot state with PROMPTS, one per slot (16 new tokens each, seed 7): by
    slots.prefill, or (shared) through a shared-prefill pool filled in reverse row order."""
    spec = s.programs.spec
    state = s.init_state(params)
    prompts = np.zeros((NUM_SLOTS, MAX_PROMPT_LEN), np.int32)
    lens = np.asarray([len(t) for _, t in PROMPTS], np.int32)
    for row, (_, tokens) in enumerate(PROMPTS):
        prompts[row, :len(tokens)] = tokens
    ids = jnp.arange(NUM_SLOTS, dtype=jnp.int32)
    args = (jnp.asarray(prompts), jnp.asarray(lens), ids, ids * 0, ids * 0 + 16, jnp.int32(0),
            jnp.uint32(7))
    if not shared:
        return slot_programs.prefill(spec, params, state, ids, *args)
    pool = prefix_programs.init_pool(spec, NUM_SLOTS)
    pool = prefix_programs.fill(spec, params, pool, ids[::-1], jnp.asarray(prompts)[::-1],
                                jnp.asarray(lens)[::-1])
    return prefix_programs.start(spec, params, state, pool, ids, ids, *args)
