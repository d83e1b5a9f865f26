"""launch/device_check.py's speed summary: every pair's lines of launch.bench_speed reach the
summary's details, and its result line becomes the key (the GPU figures are read from these)."""

from launch.device_check import summarize_speed

# The shape of `python -m launch.bench_speed --quick` output (numbers from a CPU run; the
# shared-prefill and n-gram pairs shortened to one line each).
BENCH_LOG = """\
backend cpu, tiny dims, f32, pallas (interpret mode)
== shared prefill: 2 prompts x 8 samples
   plain    1.000 s, prefill 0.500 s
   identical samples: True
== hybrid rollback: 0.17M-param Gated DeltaNet hybrid, 4 prompts, 32 new tokens
   plain     0.047 s   2744.8 tok/s, 31 decode steps
   refeed    0.063 s   2026.8 tok/s, 18 decode steps, accept rate 0.62
   settle    0.043 s   2981.9 tok/s, 18 decode steps, accept rate 0.62
   accept rate 0.62 | settle vs refeed 1.47x, settle vs plain 1.09x | identical samples: True
== draft model: 0.15M-param target, 0.04M-param layer-skip draft, 4 prompts
   plain     0.037 s   3473.1 tok/s, 31 decode steps
   draft     0.029 s   4389.2 tok/s, 8 decode steps, accept rate 0.93
   ngram     0.044 s   2896.3 tok/s, 28 decode steps, accept rate 0.30
   draft model vs plain 1.26x, n-gram vs plain 0.83x | n-gram samples identical to plain: True
   mtp       0.030 s   4224.1 tok/s, 8 decode steps, accept rate 0.93
   mtp-argmax   0.041 s   3101.9 tok/s, 17 decode steps, accept rate 0.50
   MTP head vs plain 1.23x, accept rate 0.93 (drawn drafts: the same law); argmax drafts \
(no switch) 0.90x, 17 steps, accept rate 0.50, samples identical to plain: True
some unrelated log line
spec_speedup=1.30 accept_rate=0.90 hybrid_rollback_speedup=1.47 draft_spec_speedup=1.26 mtp_spec_speedup=1.23
"""


def test_speed_summary_keeps_every_pairs_lines_and_the_result_line():
    summary = summarize_speed(BENCH_LOG)
    assert summary.key.startswith("spec_speedup=1.30") and "draft_spec_speedup=1.26" in summary.key
    assert "mtp_spec_speedup=1.23" in summary.key
    # 3 headers + 2 shared-prefill lines + 4 hybrid lines + 4 draft-model lines + 3 MTP lines
    # = 16; the backend line and the unrelated line are left out.
    assert len(summary.details) == 16
    for fragment in ("refeed", "settle", "accept rate 0.62 |", "draft     0.029", "ngram",
                     "draft model vs", "mtp       0.030", "mtp-argmax", "MTP head vs"):
        assert any(line.startswith(fragment) for line in summary.details), fragment
    assert not any("unrelated" in line for line in summary.details)


def test_speed_summary_without_a_result_line_says_so():
    assert summarize_speed("== draft model\n   plain 1 s\n").key == "no result line"
