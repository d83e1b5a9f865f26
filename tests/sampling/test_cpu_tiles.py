"""The CPU fast path keeps p_b == p_o bitwise: the platform's own tiles (whole-operand matmul
dots of 32 rows, narrower for a call of fewer rows where the probe allows, 4-row attention
query tiles, 32-position KV tiles) and batched prefill, on 1, 3, 8 and 32 slots, and with an
8-row matmul tile.

Decode batches of 1, 3, 8 and 32 rows run on narrow tiles where this machine's library rounds
them like the full one (4, 4, 8 and 32 rows on some machines) while the train recompute runs
full tiles; the
prompts have odd lengths (1, 3, 5, 7) and the recompute lays the same sequences out in two
other ways, so a row is computed at a different row offset, batch size and padding in each
stage.
"""

import importlib

import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.sampling import Sampler

from .helpers import (CONFIG, MAX_PROMPT_LEN, bits_equal, model_params, recompute_two_layouts,
                      sampling)

# The module (the jrl.kernels attribute of that name is the dispatching function).
matmul_module = importlib.import_module("jrl.kernels.matmul")

# Odd prompt lengths; 4 prompts x 3 samples = 12 requests.
ODD_PROMPTS = ((20, (5, 9, 3)), (21, (2, 7, 7, 30, 12, 4, 8)), (22, (6,)),
               (23, (3, 14, 15, 9, 2)))


@pytest.mark.parametrize("num_slots,row_tile", [(1, None), (3, None), (8, None), (32, None),
                                                (8, 8)])
def test_bitwise_cpu_platform_tiles_any_slot_count(num_slots, row_tile):
    contract = NumericalContract.for_platform(
        "cpu", **({} if row_tile is None else {"matmul_block_m": row_tile}))
    assert contract.attn_block_q == 4 and contract.attn_block_k == 32
    assert contract.matmul_block_m == (row_tile or 32)
    if row_tile is None and num_slots < 32:
        # The decode steps' MLP dots run on the narrowest tile the probe found to round like
        # 32 rows on this machine (32 where none does); the comparison below covers it.
        narrow = matmul_module.row_tile(contract, num_slots, CONFIG.hidden_size,
                                        CONFIG.intermediate_size, False)
        assert max(4, num_slots) <= narrow <= 32, narrow
    assert contract.matmul_block_k >= CONFIG.intermediate_size
    s = Sampler(CONFIG, contract, sampling(top_p=0.9), num_slots=num_slots,
                max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4)
    samples = s.generate(model_params(0), ODD_PROMPTS)
    assert len(samples) == 12
    stats = s.last_stats
    assert stats["prefills"] == 12
    if num_slots >= 8:
        # Waiting prompts are prefilled together: 12 requests in fewer calls than requests.
        assert stats["prefill_calls"] < stats["prefills"]
    p_b = [x.behavior_logp for x in samples]
    first, second = recompute_two_layouts(model_params(0), samples, contract, 1.0)
    for i in range(len(samples)):
        assert bits_equal(p_b[i], first[i]) and bits_equal(p_b[i], second[i]), i
    assert all(np.all(np.isfinite(x)) for x in p_b)


def test_prefill_bucket_is_next_power_of_two_capped_at_slots():
    from jrl.sampling.slots import prefill_bucket
    # count -> next power of two: 1 -> 1, 2 -> 2, 3 -> 4, 5 -> 8, 17 -> 32; capped at num_slots.
    assert [prefill_bucket(c, 32) for c in (1, 2, 3, 5, 17, 32)] == [1, 2, 4, 8, 32, 32]
    assert prefill_bucket(5, 6) == 6 and prefill_bucket(6, 6) == 6
