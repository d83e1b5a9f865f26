"""Qwen3.5's multi-token-prediction head (jrl.models.mtp): loaded from the checkpoint's mtp.*
tensors, and its forward against a transformers-built reference (its block is transformers' own
full-attention decoder layer and norm; see helpers.TorchMtpHead)."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import load_hf, load_hf_mtp, mtp, transformer
from .helpers import (XLA, add_tensors, save_tiny_hf, save_with_mtp, tiny_qwen35_model,
                      tiny_qwen35_moe_model)

PALLAS = NumericalContract(backend="pallas")
TOKENS = np.array([5, 17, 3, 44, 9, 60, 21, 8, 33, 12, 70, 2, 19, 4, 51, 26, 11, 38, 7, 90,
                   14], np.int32)     # 21 tokens: pairs across the 16-token delta chunk


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request, tmp_path_factory):
    target = (tiny_qwen35_model(seed=2) if request.param == "dense"
              else tiny_qwen35_moe_model(seed=2))
    directory, head = save_with_mtp(target, tmp_path_factory.mktemp(f"mtp_{request.param}"))
    return directory, head, request.param


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def head_outputs(head, params, tokens, *, config, contract):
    """The head over every pair (h_t, x_{t+1}) of one sequence tokens [1, T]: (logits, o)."""
    hidden = transformer.forward(params, config, tokens, contract=contract).hidden
    out, _ = mtp.forward(head, params, config, tokens[:, 1:], hidden[:, :-1], contract=contract)
    return mtp.logits(params, out, contract=contract), out


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def head_chunk(head, params, tokens, hidden, positions, cache, *, config, contract):
    return mtp.forward(head, params, config, tokens, hidden, contract=contract,
                       positions=positions, cache=cache)


def jrl_head_logits(directory, contract, tokens):
    config, params = load_hf(directory, dtype="float32", log=None)
    _, head = load_hf_mtp(directory, dtype="float32")
    mtp.check_params(head, config)
    logits, out = head_outputs(head, params, jnp.asarray(tokens)[None], config=config,
                               contract=contract)
    return np.asarray(logits)[0], np.asarray(out)[0]


@pytest.mark.parametrize("contract", [XLA, PALLAS], ids=["xla", "pallas"])
def test_head_matches_transformers_block(checkpoint, contract):
    directory, torch_head, _ = checkpoint
    ours, ours_out = jrl_head_logits(directory, contract, TOKENS)
    theirs, theirs_out = torch_head.logits(TOKENS)
    assert ours.shape == theirs.shape == (len(TOKENS) - 1, 97)
    np.testing.assert_allclose(ours_out, theirs_out, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # Not vacuous: the head's logits are far from uniform and differ from position to position.
    assert np.abs(theirs).max() > 0.5 and np.ptp(theirs.argmax(-1)) > 0


def test_cached_head_equals_full_sequence_bitwise(checkpoint):
    """Fed in chunks through its own cache (as the sampler catches it up), the head's outputs
    are those of one full pass: bit for bit for the dense block (stage consistency of the
    kernels). The MoE block's width-1 chunk differs by 1 ulp in 9 of 960 entries under this
    suite's older CPU emitters at -O0 (exact at XLA's defaults, checked by hand); the head's
    bits only choose drafts, never a sample's law or p_b, so that is tolerated here."""
    directory, _, family = checkpoint
    config, params = load_hf(directory, dtype="float32", log=None)
    _, head = load_hf_mtp(directory, dtype="float32")
    tokens = jnp.asarray(TOKENS)[None]
    _, full = head_outputs(head, params, tokens, config=config, contract=PALLAS)
    hidden = jax.jit(lambda p, t: transformer.forward(p, config, t, contract=PALLAS).hidden)(
        params, tokens)[:, :-1]
    pairs = tokens[:, 1:]
    cache = mtp.init_cache(config, 1, 32, PALLAS)
    outs = []
    for start, width in ((0, 7), (7, 1), (8, 5), (13, 7)):     # 20 pairs in uneven chunks
        positions = jnp.arange(start, start + width, dtype=jnp.int32)[None]
        out, cache = head_chunk(head, params, pairs[:, start:start + width],
                                hidden[:, start:start + width], positions, cache,
                                config=config, contract=PALLAS)
        outs.append(out)
    assert int(cache.lengths[0]) == 20
    chunked = np.asarray(jnp.concatenate(outs, axis=1))
    if family == "dense":
        np.testing.assert_array_equal(chunked, np.asarray(full))
    np.testing.assert_allclose(chunked, np.asarray(full), atol=1e-6, rtol=0)


def test_random_head_has_the_loaded_layout(checkpoint):
    directory, _, _ = checkpoint
    config, _ = load_hf(directory, dtype="float32", log=None)
    _, loaded = load_hf_mtp(directory, dtype="float32")
    random = mtp.init_params(config, jax.random.key(0))
    assert jax.tree.map(jnp.shape, random) == jax.tree.map(jnp.shape, loaded)
    assert jax.tree.map(jnp.shape, random) == jax.tree.map(
        tuple, mtp.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


def test_bad_mtp_checkpoints_get_one_clear_message(tmp_path):
    plain = save_tiny_hf(tiny_qwen35_model(seed=4), tmp_path / "plain")
    with pytest.raises(ValueError, match=r"plain: no multi-token-prediction head \(no mtp\.\*"):
        load_hf_mtp(plain)

    directory, head = save_with_mtp(tiny_qwen35_model(seed=4), tmp_path / "two")
    config_path = os.path.join(directory, "config.json")
    config = json.load(open(config_path))
    config["mtp_num_hidden_layers"] = 2
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match=r"config.json: mtp_num_hidden_layers=2; jrl runs an "
                                         r"MTP head of exactly 1 layer"):
        load_hf_mtp(directory)

    directory, head = save_with_mtp(tiny_qwen35_model(seed=4), tmp_path / "misshapen")
    add_tensors(directory, {"mtp.fc.weight": np.zeros((48, 48), np.float32)})
    with pytest.raises(ValueError, match=r"MTP head\): tensor mtp.fc.weight has shape \[48, 48\], "
                                         r"expected \[48, 96\]"):
        load_hf_mtp(directory)

    config_, params = load_hf(directory, dtype="float32", log=None)
    bad = mtp.init_params(config_, jax.random.key(0))
    del bad["hidden_norm"]
    with pytest.raises(ValueError, match=r"MtpHead.params: missing \['hidden_norm'\]"):
        mtp.check_params(bad, config_)


@pytest.mark.parametrize("arch", ["llama", "qwen35_moe"])
def test_save_hf_keeps_the_head_bit_for_bit(arch, tmp_path):
    """save_hf(mtp_head=...) writes the head as mtp.* tensors that load_hf_mtp reads back bit
    for bit (a dense and a MoE block); the text model still loads with the head skipped."""
    from jrl.models import save_hf
    from jrl.models.transformer import init_params
    from tests.sampling.helpers import ARCHS

    config = ARCHS[arch]
    params = init_params(config, jax.random.key(1))
    head = mtp.init_params(config, jax.random.key(2))
    save_hf(tmp_path / arch, config, params, dtype="float32", mtp_head=head)
    notes = []
    load_hf(tmp_path / arch, dtype="float32", log=notes.append)
    assert len(notes) == 1 and "mtp.*" in notes[0]
    _, loaded_head = load_hf_mtp(tmp_path / arch, dtype="float32")
    flat = jax.tree_util.tree_leaves_with_path(head)
    for path, value in flat:
        got = loaded_head
        for key in path:
            got = got[key.key]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=str(path))
    assert json.load(open(tmp_path / arch / "config.json"))["mtp_num_hidden_layers"] == 1
