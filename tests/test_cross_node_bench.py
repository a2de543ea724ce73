"""app.bench.cross_node's summary: the side-by-side ratio of the two across-node hand-overs, and
whether every decoder read the whole handed-over prompt (the engines' run is the benchmark's own,
python -m app.bench.cross_node; figures in docs/scaling.md)."""
from app.bench.cross_node import summarize, table


def _row(mode, L, shared, private, cached):
    return {"mode": mode, "L": L, "prefill_s": 1.0, "ttft_shared_s": shared, "ttft_private_s": private,
            "fanout_s": 1.0 + shared, "cached": cached, "private_cached": 0}


def test_summary_takes_medians_per_mode_and_the_ratio_of_shared_ttfts():
    rows = [_row("pool-nixl", 2048, 0.10, 8.0, 2047), _row("pool-nixl", 2048, 0.30, 9.0, 2047),
            _row("pool-nixl", 2048, 0.20, 8.5, 2047),
            _row("vllm-nixl", 2048, 0.30, 8.2, 2048), _row("vllm-nixl", 2048, 0.50, 8.4, 2048)]
    s = summarize(rows)["2048"]
    assert s["pool-nixl"]["ttft_shared_s"] == 0.2 and s["vllm-nixl"]["ttft_shared_s"] == 0.4
    assert s["vllm_over_pool_shared"] == 2.0 and s["vllm_over_pool_fanout"] == round(1.4 / 1.2, 2)
    assert s["pool-nixl"]["all_read"] and s["vllm-nixl"]["all_read"]
    assert "| 2048 | 200 ms | 400 ms | 2.0x |" in table(summarize(rows))


def test_a_decoder_that_read_less_than_the_prompt_is_flagged_and_one_mode_has_no_ratio():
    s = summarize([_row("vllm-nixl", 4096, 0.2, 20.0, 4000)])["4096"]
    assert s["vllm-nixl"]["all_read"] is False
    assert "vllm_over_pool_shared" not in s and "pool-nixl" not in s
