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


WIDTH = 70  # characters of an answer on its line (a row: ~120)
CUT = "…"  # where a shown answer stops before the model's did (max_tokens, or the line's width)
NAME_W = 20
COLUMNS = f"{'request':<{NAME_W}} {'prompt':>9}  {'Omega_MSR':>9}  {'time':>6}  answer"


def header(model: str, layers: int | None, kv_heads: int | None, device: str, router: str, force: str) -> str:
    """What the rows of the demo's printout are: the columns, what Omega_MSR is, what a mark means."""
    heads = f"{layers} layers x {kv_heads} KV heads" if layers and kv_heads else "every layer's KV heads"
    return "\n".join(
        [
            f"{model} on the {device}, --attention-backend elastic, router: {router}, force: {force}",
            f"Omega_MSR = share of the request's KV heads ({heads}) the router sent to SA (sink + sliding window);",
            "  0.000 = every head full attention (FA, dense), 1.000 = every head SA. Read from the server's /metrics.",
            f"Answer: the model's completion, greedy; {CUT} = cut there (by max_tokens, or to fit the line);",
            "  [repeats N prompt lines] = it first wrote back N lines of the prompt, left out here.",
            "",
            COLUMNS,
            "-" * len(COLUMNS),
        ]
    )


def shown_answer(text: str, prompt: str, stopped_by_length: bool, width: int = WIDTH) -> str:
    """The model's completion on one line: without the lines it copied from the prompt first (a code model often
    restarts the function it was given) and Markdown fences, whitespace collapsed, cut to ``width`` characters; CUT
    where it stops before the model's own end (``stopped_by_length``: max_tokens ended it)."""
    prompt_lines = {x.strip() for x in prompt.splitlines() if x.strip()}
    lines = text.splitlines()
    echoed = i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line and line not in prompt_lines and not line.startswith("```"):
            break
        echoed += bool(line) and not line.startswith("```")
        i += 1
    rest = " ".join(" ".join(x for x in lines[i:] if not x.strip().startswith("```")).split())  # no fences
    prefix = f"[repeats {echoed} prompt line{'s' if echoed != 1 else ''}] " if echoed else ""
    if not rest:
        return prefix + ("(nothing else)" if echoed else "(empty)") + (CUT if stopped_by_length else "")
    room = width - len(prefix)
    if len(rest) > room:
        return prefix + rest[: room - 1].rstrip() + CUT
    return prefix + rest + (CUT if stopped_by_length else "")


def format_row(row: dict) -> str:
    """One request's line: name, prompt tokens, Omega_MSR (3 decimals; "-" when the server recorded none), seconds,
    then [correct] / [WRONG] for the needle and the answer."""
    msr = "-" if row["omega_msr"] is None else f"{row['omega_msr']:.3f}"
    mark = "" if "correct" not in row else "[correct] " if row["correct"] else "[WRONG] "
    return (
        f"{row['request']:<{NAME_W}} {row['prompt_tokens']:>5} tok  {msr:>9}  {row['seconds']:>4.1f} s  "
        f"{mark}{row['answer']}"
    )


def _on_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _shape(model) -> tuple[int | None, int | None]:
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    return cfg.get("num_hidden_layers"), cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))


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
        # 96 tokens: the demo model first writes back lines of the function it was given (4 with the shipped router),
        # and 48 left it 2 words of its own
        ("code (robust)", [{"role": "user", "content": "Complete this Python function:\n\n" + CODE}], None, 96),
    ]
    device = "GPU" if _on_cuda() else "CPU"
    print(f"serving {model} with --attention-backend elastic ({device}) ...", file=sys.stderr)
    rows = []
    with ServeProcess(model, elastic=elastic, args=args, served_name="smollm2") as srv:
        srv.wait_ready(timeout_s, progress=None)
        client = OpenAI(base_url=srv.base + "/v1", api_key="unused")
        router_name = router or "the shipped router for this model (router_weights/)"
        print(header(model.name, *_shape(model), device, router_name if force == "auto" else "not used", force))
        for name, messages, answer, max_tokens in jobs:
            before = metric_value(srv.metrics(), "elastic:request_omega_msr_sum")
            n_before = metric_value(srv.metrics(), "elastic:request_omega_msr_count")
            t = time.perf_counter()
            if isinstance(messages, str):  # already chat-templated text (the needle): /v1/completions
                out = client.completions.create(model="smollm2", prompt=messages, max_tokens=max_tokens, temperature=0)
                text, prompt = out.choices[0].text or "", messages
            else:
                out = client.chat.completions.create(
                    model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0
                )
                text, prompt = out.choices[0].message.content or "", messages[0]["content"]
            secs = time.perf_counter() - t
            m = srv.metrics()
            recorded = metric_value(m, "elastic:request_omega_msr_count") - n_before
            msr = metric_value(m, "elastic:request_omega_msr_sum") - before
            row = {
                "request": name,
                "prompt_tokens": out.usage.prompt_tokens,
                "omega_msr": round(msr, 3) if recorded == 1 else None,
                "seconds": round(secs, 1),
                "answer": shown_answer(text, prompt, out.choices[0].finish_reason == "length"),
            }
            if answer is not None:
                row["correct"] = answer in text
            rows.append(row)
            print(format_row(row), flush=True)
    return rows
