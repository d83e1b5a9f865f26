"""Pretrained weights: `load(path)` -> a Decoder (jrl.models.nnx_model) from an HF directory or a
GGUF file, with its tokenizer; `load_weights(key, source, path, numerics)`, the loader of a run
config's model.source ("hf", "gguf", "smollm2"); and the one merge of a model config's eos ids
into its tokenizer's stop ids."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from jrl import paths
from jrl.kernels.contract import NumericalContract
from jrl.models.gguf_import import load_gguf, load_gguf_tokenizer, smollm2_gguf_path
from jrl.models.hf_checkpoint import CONFIG_FILE, load_hf
from jrl.models.tokenizer import TOKENIZER_FILE, HFTokenizer, load_hf_tokenizer


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """Loads a tokenizer from an HF directory (tokenizer.json [+ tokenizer_config.json,
    chat_template.jinja]), a tokenizer.json file, or a .gguf file (its metadata)."""
    path = os.fspath(path)
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path)


def _resolve_contract(contract: NumericalContract | None, dtype: Any) -> NumericalContract:
    """The contract decides the param dtype; `dtype` alone makes a default contract with it."""
    if dtype is None:
        return contract if contract is not None else NumericalContract()
    name = jnp.dtype(dtype).name
    if contract is None:
        return NumericalContract(param_dtype=name)
    if contract.param_dtype != name:
        raise ValueError(f"load(dtype={name!r}) disagrees with contract.param_dtype="
                         f"{contract.param_dtype!r}; pass one of them")
    return contract


def _eos_ids(eos: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, tuple) else (int(eos),)


def with_eos_stops(tokenizer, config):
    """`tokenizer` with the model config's eos ids among its stop ids; a tokenizer without
    stop ids of its own to extend (None, the character tokenizer) as it is."""
    if not hasattr(tokenizer, "with_stop_ids"):
        return tokenizer
    return tokenizer.with_stop_ids(_eos_ids(config.eos_token_id))


def load_weights(key: str, source: str, path: str | None, numerics):
    """(ModelConfig, params, tokenizer or None) of a checkpoint: source "hf" (a directory),
    "gguf" (a file, with its tokenizer) or "smollm2" (the packaged GGUF); `key` names the
    config field in the error for a missing path."""
    if source == "smollm2":
        return load_gguf(smollm2_gguf_path(), dtype=numerics.params)
    paths.require_path(key, path)
    if source == "gguf":
        if os.path.isdir(path):
            raise ValueError(f"{key}={path!r} is a directory; a GGUF model is one .gguf file "
                             "(a Hugging Face checkpoint directory is model.source='hf')")
        return load_gguf(path, dtype=numerics.params)
    config, params = load_hf(path, dtype=numerics.param_dtype)
    return config, params, None


def load_pretrained(path: str | os.PathLike, *, contract: NumericalContract | None = None,
                    dtype: Any = None) -> tuple:
    """(config, params, tokenizer or None, contract) of an HF directory or a .gguf file; see
    `load` for the arguments."""
    contract = _resolve_contract(contract, dtype)
    path = os.fspath(path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, CONFIG_FILE)):
            raise FileNotFoundError(f"load({path!r}): the directory has no {CONFIG_FILE}; "
                                    "expected a Hugging Face checkpoint directory or a .gguf file")
        config, params = load_hf(path, dtype=contract.param_dtype)
        tokenizer = (load_tokenizer(path) if os.path.exists(os.path.join(path, TOKENIZER_FILE))
                     else None)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        config, params, tokenizer = load_gguf(path, dtype=contract.param_dtype)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"load({path!r}): no such file or directory")
    else:
        raise ValueError(f"load({path!r}): expected a Hugging Face checkpoint directory "
                         "(config.json + model.safetensors) or a .gguf file")
    return config, params, with_eos_stops(tokenizer, config), contract
