"""launch/bench_self_speculative.py: the cost model's arithmetic and the result file's table."""

import pytest

from launch.bench_self_speculative import predicted_ratio, render


def test_the_cost_model_by_hand():
    # k = 4, E = 4.63 tokens per window, t_fast = 1.8 ms, t_exact = 9.6 ms:
    # a window costs (4 + 1) * 1.8 + 9.6 = 18.6 ms, 18.6 / 4.63 = 4.0173 ms per token,
    # and 1.8 / 4.0173 = 0.44806 of XLA's speed.
    assert predicted_ratio(4, 4.63, 1.8, 9.6) == pytest.approx(0.44806, abs=1e-5)
    # Every draft accepted at k = 4 (E = 5): (9 + 9.6) / 5 = 3.72 ms, 1.8 / 3.72 = 0.48387.
    assert predicted_ratio(4, 5.0, 1.8, 9.6) == pytest.approx(0.48387, abs=1e-5)
    # No draft accepted (E = 1) costs more than plain exact decoding's 1.8 / 9.6 = 0.1875.
    assert predicted_ratio(4, 1.0, 1.8, 9.6) < 1.8 / 9.6


def test_a_result_file_renders_one_row_per_setting():
    row = dict(dtype="bfloat16", temperature=1.0, slots=8, num_draft=4, acceptance=0.9521,
               tokens_per_window=4.634, exact_tok_s=54.61, xla_tok_s=61.52, self_tok_s=30.63,
               bitwise_equal_to_exact=True, predicted_accelerator_exact_over_xla=0.4481,
               accelerator_plain_exact_over_xla=0.1875)
    result = dict(machine=dict(platform="cpu", cpu_count=2, jax="0.10.2"), commit="0123456789ab",
                  date="2026-12-06T00:00:00+00:00", rows=[row, dict(row, slots=32)],
                  inputs=dict(new_tokens=64, gpu_fast_ms=1.8, gpu_exact_ms=9.6, model="m"))
    table = render(result).splitlines()
    assert table[0].startswith("m, cpu (2 cores), JAX 0.10.2; commit 0123456789")
    assert table[-2] == ("| bfloat16 | 1.0 | 8 | 4 | 0.952 | 4.63 | 54.6 | 61.5 | 30.6 | yes | "
                         "0.45x (0.19x) |")
    assert table[-1].startswith("| bfloat16 | 1.0 | 32 |")
