"""Small helpers shared by the engine tests."""

from __future__ import annotations

import gc

import torch

from elastic_vllm.vllm_plugin import observe

# Two logits closer than this may fall either way between engines: vLLM's and transformers' keys agree to
# ~1e-5 (float32, different kernels and summation orders), which moves a router logit by < 1e-4.
LOGIT_EPS = 1e-3


def close_llm(llm) -> None:
    """Shut a vLLM ``LLM`` down (its engine core and, with TP, its workers) and free what it held."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def event_of(request_id: str) -> observe.RoutingEvent:
    """The routing event of an engine request (the worker sees vLLM's internal id "<id>-<uuid8>"). Each
    LLM numbers its requests from 0, so with several engines in one process the latest event is ours."""
    found = [e for e in observe.events() if e.req_id == request_id or e.req_id.rsplit("-", 1)[0] == request_id]
    assert found, f"no routing event for {request_id}"
    return found[-1]


def compare_decisions(event: observe.RoutingEvent, ref_logits: torch.Tensor) -> int:
    """Assert the engine's decisions equal the reference's wherever the reference margin exceeds
    LOGIT_EPS; return how many (layer, head) decisions were compared."""
    margin = ref_logits[..., 1] - ref_logits[..., 0]
    sure = margin.abs() > LOGIT_EPS
    ref_fa = margin > 0
    bad = (event.decisions != ref_fa) & sure
    assert not bad.any(), f"decisions differ at (layer, head) {bad.nonzero().tolist()}"
    torch.testing.assert_close(event.logits, ref_logits.float(), atol=5e-3, rtol=1e-3)
    return int(sure.sum())


def greedy(
    max_tokens: int = 12, logprobs: int | None = None, force: str | None = None, xargs: dict | None = None, **kw
):
    """Greedy sampling; ``force`` is ``elastic_force``, ``xargs`` more extra args (``elastic_bias``, ...)."""
    from vllm import SamplingParams

    extra = {**({"elastic_force": force} if force else {}), **(xargs or {})} or None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, extra_args=extra, **kw)


def top_logprobs(out) -> list[float]:
    """The chosen token's logprob at every generated step."""
    return [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
