import pytest

pytest.importorskip("vllm")

from kvpool.ops import demo


@pytest.mark.vllm
def test_demo_small_workload_loads_from_the_pool_with_identical_outputs():
    workload = demo.Workload(
        system_prompts=1,
        conversations=4,
        turns=3,
        system_tokens=128,
        user_tokens=64,
        answer_tokens=16,
        kv_cache_tokens=768,  # the engine's own cache holds fewer than the four conversations
        model_kind="llama",
    )
    result = demo.run(quiet=True, workload=workload)
    assert result["requests"] == 12
    assert result["identical_outputs"] is True
    assert result["tokens_loaded_from_pool"] > 0
    assert 0 < result["pool_hit_rate"] <= 1
    for key in ("prompt_tokens", "ttft_p50_ms_without", "ttft_p50_ms_with"):
        assert result[key] > 0
