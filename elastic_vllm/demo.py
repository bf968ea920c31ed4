"""``elastic-vllm demo``: the main job on the embedded default.

Fetches the demo model (SmolLM2-135M-Instruct), serves it with ``vllm serve --attention-backend elastic``
(on the CPU when there is no GPU) with the shipped router, sends three requests of different kinds through
the OpenAI API — a needle retrieval (sparsity-sensitive), a summary and a code completion (sparsity-robust) —
and prints each answer with the sparsity the router chose for it (Omega_MSR, read from the server's own
``elastic:`` Prometheus metrics), then stops the server.
"""

from __future__ import annotations

import sys
import time

DOC = (
    "The lighthouse on the northern cape was built in 1871 after three ships were lost on the reef in a single "
    "winter. Its first keeper, a former sailor, kept a log of every vessel that passed, the weather at dawn and "
    "dusk, and the oil burned each night. In 1932 the lamp was electrified and the keeper's cottage became a "
    "small museum. Today volunteers maintain the tower, guide visitors up its 142 steps, and restore the log "
    "books, which historians use to study storms and shipping on the coast over sixty years. "
)
CODE = '''def moving_average(values, window):
    """Return the list of averages of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
'''


def _on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_demo(
    router: str | None = None, force: str = "auto", needle_tokens: int = 1500, timeout_s: float = 900
) -> list[dict]:
    from openai import OpenAI
    from transformers import AutoTokenizer

    from elastic_vllm.eval.needle import make_needle_prompt
    from elastic_vllm.models import fetch_demo_model
    from elastic_vllm.server import ServeProcess, metric_value

    model = fetch_demo_model()
    tok = AutoTokenizer.from_pretrained(model)
    elastic: dict = {"force": force, "sink": 128, "window": 512}
    if router:
        elastic["router_path"] = router
    args = ["--max-model-len", "4096"]
    if not _on_cuda():  # float32 is ~4x faster than bf16 on CPUs without AMX; bound the CPU KV cache
        args += ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "256M"]
    needle = make_needle_prompt(tok, needle_tokens, depth=0.4, seed=7)
    # the needle prompt ends with RULER's answer prefix (the model answers at once), so it goes as raw text
    jobs = [
        ("needle (sensitive)", needle.text(tok), needle.answer, 12),
        ("summary (robust)", [{"role": "user", "content": "Summarize in one sentence:\n\n" + DOC * 6}], None, 48),
        ("code (robust)", [{"role": "user", "content": "Complete this Python function:\n\n" + CODE}], None, 48),
    ]
    print(f"serving {model} with --attention-backend elastic ({'GPU' if _on_cuda() else 'CPU'}) ...", file=sys.stderr)
    rows = []
    with ServeProcess(model, elastic=elastic, args=args, served_name="smollm2") as srv:
        srv.wait_ready(timeout_s, progress=None)
        client = OpenAI(base_url=srv.base + "/v1", api_key="unused")
        for name, messages, answer, max_tokens in jobs:
            before = metric_value(srv.metrics(), "elastic:request_omega_msr_sum")
            n_before = metric_value(srv.metrics(), "elastic:request_omega_msr_count")
            t = time.perf_counter()
            if isinstance(messages, str):  # already chat-templated text (the needle): /v1/completions
                out = client.completions.create(model="smollm2", prompt=messages, max_tokens=max_tokens, temperature=0)
                text = out.choices[0].text or ""
            else:
                out = client.chat.completions.create(
                    model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0
                )
                text = out.choices[0].message.content or ""
            secs = time.perf_counter() - t
            m = srv.metrics()
            recorded = metric_value(m, "elastic:request_omega_msr_count") - n_before
            msr = metric_value(m, "elastic:request_omega_msr_sum") - before
            row = {
                "request": name,
                "prompt_tokens": out.usage.prompt_tokens,
                "omega_msr": round(msr, 3) if recorded == 1 else None,
                "seconds": round(secs, 1),
                "answer": text.strip().replace("\n", " ")[:100],
            }
            if answer is not None:
                row["correct"] = answer in text
            rows.append(row)
            print(
                f"{name:<20} {row['prompt_tokens']:>5} tok  Omega_MSR {row['omega_msr']}  {secs:5.1f} s  "
                f"{'[correct] ' if row.get('correct') else '[WRONG] ' if 'correct' in row else ''}{row['answer']}"
            )
    return rows
