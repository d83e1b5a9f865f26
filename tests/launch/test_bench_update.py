"""launch/bench_update.py: every row times both backends of its program (on a tiny model here),
and a result file renders as the docs table."""

import jax

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from launch import bench_update

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


def test_every_program_is_timed_for_both_backends():
    contracts = {b: NumericalContract.for_platform(jax.default_backend(), backend=b)
                 for b in bench_update.BACKENDS}
    rows = bench_update.rows_for(TINY, contracts, batch=2, seq=8, repeats=1)
    assert [row[0] for row in rows] == ["forward", "forward+grad", "train step", "matmul bwd",
                                        "attention bwd", "logprob bwd"]
    for name, pallas, xla, ratio in rows:
        assert pallas > 0 and xla > 0 and ratio == xla / pallas, name


def test_a_result_file_renders_as_a_table():
    result = dict(jax="0.0", commit="0123456789abcdef", date="2026-01-01T00:00:00+00:00",
                  machine=dict(cpu_model="a CPU", processor="x", cpu_count=2, platform="cpu"),
                  inputs=dict(layers=30, batch=8, seq=96, repeats=3),
                  rows=[dict(program="train step", pallas=2.0, xla=1.5,
                             pallas_over_xla_speed=0.75)])
    assert bench_update.render(result).splitlines()[-1] == "| train step | 2.000 | 1.500 | 0.75x |"
