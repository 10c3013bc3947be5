import pytest
from tests.sglang.harness import Harness

@pytest.mark.sglang
async def test_smoke(tiny_moe):
    h = Harness(tiny_moe, skip_tokenizer_init=True)
    st, body = await h.post({"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True})
    print(st, body)
    h2 = Harness(tiny_moe, skip_tokenizer_init=False)
    st, body = await h2.post({"text": "hello world", "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True})
    print(st, body)
