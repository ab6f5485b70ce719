"""FlashInfer backend against the SDPA backend on the same inputs (CUDA + flashinfer only)."""

import pytest
import torch

from engine.attention import flashinfer as fi_backend
from engine.attention.sdpa import SDPABackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fi_backend.available(), reason="needs CUDA and flashinfer-python (the gpu extra)"),
]


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_and_merge_match_sdpa(causal: bool) -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    q = torch.randn(128, 8, 64, device=dev, dtype=dt)
    k = torch.randn(128 if causal else 512, 2, 64, device=dev, dtype=dt)
    v = torch.randn_like(k)
    fi, ref = fi_backend.FlashInferBackend(), SDPABackend()
    out, _ = fi.tile(q, k, v, causal)
    want, _ = ref.tile(q.float(), k.float(), v.float(), causal)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    if not causal:  # two key tiles merged equal one tile over all keys
        a, b = fi.tile(q, k[:200], v[:200], False), fi.tile(q, k[200:], v[200:], False)
        merged = fi.merge([a[0], b[0]], [a[1], b[1]])
        torch.testing.assert_close(merged.float(), want, atol=2e-2, rtol=2e-2)


def test_engine_greedy_matches_sdpa_backend() -> None:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    prompts = [list(range(1, 300)), list(range(5, 40))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for backend in ("flashinfer", "sdpa"):
        engine = Engine(EngineConfig(device="cuda", attention_backend=backend)).start()
        try:
            results[backend] = [r.output_token_ids for r in engine.generate(prompts, params)]
            assert engine.kv.num_free_blocks == engine.kv.num_blocks
        finally:
            engine.shutdown()
    assert results["flashinfer"] == results["sdpa"]
