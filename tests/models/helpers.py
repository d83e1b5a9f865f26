"""Builders shared by the models tests: tiny random transformers checkpoints and tiny GGUFs.

(A plain module next to conftest.py, imported relatively by the tests.)
"""

from __future__ import annotations

import os

import numpy as np

from jrl.kernels.contract import NumericalContract

XLA = NumericalContract(backend="xla")

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Tiny shapes: hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128. Qwen3's head_dim 32 differs
# from hidden / heads = 16 on purpose.
TINY_HF = {
    "llama": dict(tie_word_embeddings=True),
    "llama_untied": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=False, head_dim=32),
    # Llama 3's RoPE scaling: with head_dim 16 and theta 5000 the wavelengths 2 pi / f_i span
    # all three of its bands for L = 32 (kept < 8 <= blended <= 32 < interpolated).
    "llama_rope3": dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    # YaRN (Qwen3's and Qwen2.5's long-context configs), L = 64, theta 5000. Qwen3 (d = 32,
    # betas 32 / 1): the ramp runs from floor(-2.15) -> 0 to ceil(4.36) = 5, so dim 0 is kept,
    # 1-4 blended, 5-15 interpolated; attention factor 0.1 ln 4 + 1. Qwen2 (d = 16): the old
    # "type" key, truncate off, explicit betas and attention factor.
    # Llama 3.1's own bands and context (convert_hf_to_gguf.py's defaults, for GGUF's rope_freqs):
    # with head_dim 16 and theta 5000 the wavelengths are 6.28 ... 1288 (kept, < 8192 / 4),
    # 3736 (blended) and 10834 (interpolated, > 8192).
    "llama_rope31": dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "qwen3_yarn": dict(tie_word_embeddings=False, head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2_yarn": dict(tie_word_embeddings=False, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25}),
}


def tiny_hf_model(kind: str, *, seed: int = 0, vocab_size: int = 128):
    """A randomly initialised transformers model of family `kind` (a key of TINY_HF).

    Every parameter is drawn from N(0, 0.1) (norm scales 1 + N(0, 0.1), biases too), so that
    biases, norms and RoPE all move the logits measurably.
    """
    import torch
    import transformers

    family = kind.split("_")[0]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    model_class = {"llama": transformers.LlamaForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM,
                   "qwen3": transformers.Qwen3ForCausalLM}[family]
    config = config_class(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
                          bos_token_id=1, eos_token_id=2, **TINY_HF[kind])
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.1 * torch.randn_like(param)
            param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def save_tiny_hf(model, directory, *, dtype=None, max_shard_size=None) -> str:
    import torch

    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return os.fspath(directory)


def right_padded_batch(vocab_size: int, lengths, *, seed: int = 0):
    """tokens [B, T] int32 (pad id 0 after each row's length) and mask [B, T] bool."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    tokens = rng.integers(3, vocab_size, size=(len(lengths), width)).astype(np.int32)
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    return np.where(mask, tokens, 0).astype(np.int32), mask


def transformers_logits(model, tokens, mask) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(mask, dtype=torch.long))
    return out.logits.float().numpy()


# ------------------------------------------------------------------------------------------------
# tiny GGUF


def byte_level_vocab():
    """(tokens, token_types, merges) of a small byte-level BPE: 3 control tokens, the 256 byte
    symbols, and merged tokens for a few English pieces."""
    from gguf import TokenType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o r", "Ġw or", "l d",
              "Ġwor ld", "l l", "H e", "He ll", "Hell o"]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = specials + byte_symbols + merged
    types = [TokenType.CONTROL] * len(specials) + [TokenType.NORMAL] * (len(tokens) - 3)
    return tokens, [int(t) for t in types], merges


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of jrl."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def hf_state_numpy(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().float().numpy().copy()
            for name, tensor in model.state_dict().items()}


def llama_cpp_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a rope_type "llama3" config, written out
    independently of jrl: per frequency 1 (kept), factor (interpolated) or
    1 / ((1 - s) / factor + s) (blended), from float32 frequencies."""
    import math

    block = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (block["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = block["factor"], block["low_freq_factor"], block["high_freq_factor"]
    context = block["original_max_position_embeddings"]
    out = []
    for freq in freqs.astype(np.float32):
        wavelength = 2 * math.pi / float(freq)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_tiny_gguf(path, model, *, arch: str = "llama", quantize: dict | None = None,
                    drop: tuple[str, ...] = (), extra_metadata=None, pre: str = "smollm",
                    rope_freqs: np.ndarray | None = None) -> str:
    """Writes `model` (a tiny transformers model whose vocab is byte_level_vocab()) as a GGUF the
    way convert_hf_to_gguf.py does: GGUF names, q/k rows permuted for llama, F32 tensors (or
    quantize: {gguf name: GGMLQuantizationType}), and rope_freqs.weight where given (Llama 3's
    scaling: llama_cpp_rope_factors). `drop` removes GGUF tensors by name."""
    import gguf

    config = model.config
    tokens, types, merges = byte_level_vocab()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(SMOLLM2_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)

    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    state = hf_state_numpy(model)
    tensors = {}
    for name, array in state.items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = array
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                tensors["output.weight"] = array
        else:
            _, _, layer, suffix = name.split(".", 3)
            if arch == "llama" and suffix == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, heads)
            elif arch == "llama" and suffix == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, kv_heads)
            tensors[f"blk.{layer}.{layer_names[suffix]}"] = array
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    for name, array in tensors.items():
        if name in drop:
            continue
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def tiny_gguf_source_model(kind: str = "llama", *, seed: int = 1):
    """A tiny model whose vocabulary is byte_level_vocab()."""
    tokens, _, _ = byte_level_vocab()
    return tiny_hf_model(kind, seed=seed, vocab_size=len(tokens))


# ------------------------------------------------------------------------------------------------
# tiny Qwen3.5 / MoE checkpoints

# Odd dims on purpose: value heads != key heads, key head dim != value head dim, GQA, a layer
# pattern that is not every-4th, head_dim 16 with partial rotary 0.25 (4 rotary features).
QWEN35_TEXT = dict(
    vocab_size=97, hidden_size=48, intermediate_size=56, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                 "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25})
QWEN35_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                     out_hidden_size=48, patch_size=4, num_position_embeddings=16)


def perturb(model, *, seed: int, scale: float = 0.1):
    """Adds N(0, scale) to every parameter, so norms (zero-centred here: 1 + w), biases and
    decays all move the logits measurably."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(scale * torch.randn_like(param))
    return model.eval()


def tiny_qwen35_model(*, seed: int = 0, tie_word_embeddings: bool = False, **changes):
    """A random transformers Qwen3_5ForCausalLM (text model) with QWEN35_TEXT's shapes."""
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(**{**QWEN35_TEXT, **changes},
                                            tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3_5ForCausalLM(config), seed=seed + 1)


def tiny_qwen35_multimodal(*, seed: int = 0):
    """A random Qwen3_5ForConditionalGeneration (the Hub's form: text model under
    model.language_model, a vision tower under model.visual)."""
    import torch
    import transformers

    config = transformers.Qwen3_5Config(text_config=QWEN35_TEXT, vision_config=QWEN35_VISION,
                                        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3_5ForConditionalGeneration(config), seed=seed + 1)


def add_tensors(directory, extra: dict) -> None:
    """Adds tensors (name -> numpy array) to a saved single-file checkpoint (e.g. the Hub's
    multi-token-prediction head, which transformers itself does not write)."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(os.fspath(directory), "model.safetensors")
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


# Qwen3-MoE: odd dims (vocab 53, hidden 40, expert width 20, dense width 36, head_dim 12 != 40 /
# 4), 5 experts top-2, layer 1 dense (mlp_only_layers) between sparse layers 0 and 2.
QWEN3_MOE = dict(
    vocab_size=53, hidden_size=40, intermediate_size=36, moe_intermediate_size=20,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    num_experts=5, num_experts_per_tok=2, mlp_only_layers=[1], decoder_sparse_step=1,
    norm_topk_prob=False, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1,
    eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Qwen3.5-MoE (every layer sparse, with the shared expert): QWEN35_TEXT's hybrid schedule.
QWEN35_MOE = dict(
    {k: v for k, v in QWEN35_TEXT.items() if k != "intermediate_size"},
    moe_intermediate_size=20, shared_expert_intermediate_size=28, num_experts=5,
    num_experts_per_tok=3)


def tiny_qwen3_moe_model(*, seed: int = 0, tie_word_embeddings: bool = False, **changes):
    """A random transformers Qwen3MoeForCausalLM with QWEN3_MOE's shapes (perturbed: the
    router, whose init is 0, routes by real logits)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **changes},
                                         tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3MoeForCausalLM(config), seed=seed + 1)


def tiny_qwen35_moe_model(*, seed: int = 0, **changes):
    """A random transformers Qwen3_5MoeForCausalLM (text model) with QWEN35_MOE's shapes."""
    import torch
    import transformers

    config = transformers.Qwen3_5MoeTextConfig(**{**QWEN35_MOE, **changes},
                                               tie_word_embeddings=False)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3_5MoeForCausalLM(config), seed=seed + 1)


def expert_tensor_names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(os.fspath(directory), "model.safetensors"), "np") as f:
        return sorted(name for name in f.keys() if ".mlp.experts." in name)


def fuse_experts(directory, out) -> str:
    """Rewrites a per-expert checkpoint (experts.{e}.gate_proj / up_proj / down_proj.weight, as
    transformers 5 saves) into the stacked 3-D layout (experts.gate_up_proj [E, 2F, D] with
    gate rows first, experts.down_proj [E, D, F]), written out here with numpy independently of
    jrl's mapping. Copies config.json."""
    import re
    import shutil

    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(os.fspath(directory), "model.safetensors"))
    pattern = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    per_layer: dict = {}
    fused = {}
    for name, array in tensors.items():
        match = pattern.fullmatch(name)
        if match is None:
            fused[name] = array
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        per_layer.setdefault(prefix, {}).setdefault(proj, {})[expert] = array
    for prefix, projs in per_layer.items():
        num = len(projs["gate"])
        fused[prefix + ".gate_up_proj"] = np.stack(
            [np.concatenate([projs["gate"][e], projs["up"][e]], axis=0) for e in range(num)])
        fused[prefix + ".down_proj"] = np.stack([projs["down"][e] for e in range(num)])
    os.makedirs(out, exist_ok=True)
    save_file(fused, os.path.join(os.fspath(out), "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(os.fspath(directory), "config.json"), os.fspath(out))
    return os.fspath(out)


# ------------------------------------------------------------------------------------------------
# Qwen3.5's multi-token-prediction head (transformers has no MTP module: its block is built as a
# one-layer transformers text model, whose layer and final norm are the head's)


class TorchMtpHead:
    """A random MTP head for a transformers Qwen3.5 (dense or MoE) text model: the pre-fc norms
    and fc as torch modules, the block as a 1-layer full-attention model of the same family."""

    def __init__(self, target, *, seed: int):
        import torch

        text_config = target.config
        block_config = text_config.__class__(**{
            **text_config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"],
            "tie_word_embeddings": False})
        torch.manual_seed(seed)
        module = type(target.model)
        self.block = perturb(module(block_config), seed=seed + 1, scale=0.3)
        norm_type = type(target.model.norm)
        d = text_config.hidden_size
        self.embed_norm = perturb(norm_type(d, eps=text_config.rms_norm_eps), seed=seed + 2)
        self.hidden_norm = perturb(norm_type(d, eps=text_config.rms_norm_eps), seed=seed + 3)
        self.fc = perturb(torch.nn.Linear(2 * d, d, bias=False), seed=seed + 4, scale=0.2)
        self.target = target

    def tensors(self) -> dict:
        """The head's checkpoint tensors (the Hub's mtp.* names), as numpy arrays."""
        out = {f"mtp.{name}": value.detach().float().numpy()
               for name, value in self.block.state_dict().items()
               if name.startswith(("layers.", "norm."))}
        out["mtp.pre_fc_norm_embedding.weight"] = self.embed_norm.weight.detach().numpy()
        out["mtp.pre_fc_norm_hidden.weight"] = self.hidden_norm.weight.detach().numpy()
        out["mtp.fc.weight"] = self.fc.weight.detach().numpy()
        return out

    def logits(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """tokens [T] (one sequence) -> (head logits [T - 1, V], head output [T - 1, D]) at
        positions 0 .. T - 2: the pair (h_t, x_{t+1}) predicts x_{t+2}."""
        import torch

        ids = torch.as_tensor(np.asarray(tokens)[None, :], dtype=torch.long)
        with torch.no_grad():
            hidden = self.target.model(input_ids=ids).last_hidden_state[:, :-1]
            e = self.embed_norm(self.target.model.embed_tokens(ids[:, 1:]))
            u = self.fc(torch.cat([e, self.hidden_norm(hidden)], dim=-1))
            out = self.block(inputs_embeds=u).last_hidden_state
            logits = self.target.lm_head(out)
        return logits[0].float().numpy(), out[0].float().numpy()


def save_with_mtp(target, directory, *, seed: int = 7) -> tuple[str, TorchMtpHead]:
    """Saves `target` with a random MTP head added (as the Hub's checkpoints carry one)."""
    head = TorchMtpHead(target, seed=seed)
    path = save_tiny_hf(target, directory)
    add_tensors(path, head.tensors())
    return path, head
