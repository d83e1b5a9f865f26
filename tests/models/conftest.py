"""Fixtures of the models tests (helpers live in helpers.py)."""

import pytest

from .helpers import TINY_HF, save_tiny_hf, tiny_hf_model


@pytest.fixture(scope="session")
def tiny_hf_checkpoints(tmp_path_factory):
    """kind -> (directory, torch model) for every TINY_HF kind, float32, single file."""
    out = {}
    for kind in TINY_HF:
        model = tiny_hf_model(kind)
        out[kind] = (save_tiny_hf(model, tmp_path_factory.mktemp(kind)), model)
    return out
