"""Build the accuracy harness's data files (run once, on a machine with PyPI access; the files are committed).

    python3 -m elastic_vllm.eval.prepare --model DIR --lengths 4096 8192 --samples 25 \\
        --out-prefix elastic_vllm/eval/data/smollm2

writes ``{prefix}_ruler.jsonl.xz`` (RULER, ``ruler.py``), ``{prefix}_robust.jsonl.xz`` (summ / cont / code,
``robust.py``, plus the static hybrid's calibration needle prompts, task "calib", ``baselines.py``) and
``{prefix}_manifest.json`` (command, versions, seeds, counts, sizes, sha256). xz rather than gzip: the
RULER haystacks repeat across samples far beyond gzip's 32 KB window.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

from elastic_vllm.eval.robust import ROBUST_TASKS
from elastic_vllm.eval.ruler import PACKAGE_REQ, RULER_TASKS, generate_ruler, read_jsonl, write_jsonl
from elastic_vllm.models import sha256_file


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="model folder whose tokenizer (and chat template) formats the prompts"
    )
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--samples", type=int, default=25, help="RULER samples per task and length")
    p.add_argument("--summ", type=int, default=10, help="summarization samples per length")
    p.add_argument("--cont", type=int, default=10, help="continuation samples per length")
    p.add_argument("--code", type=int, default=20, help="code-completion samples per length")
    p.add_argument("--calib", type=int, default=8, help="static-hybrid calibration prompts per length")
    p.add_argument("--tasks", nargs="+", default=list(RULER_TASKS), choices=list(RULER_TASKS), help="RULER tasks")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--only", choices=["ruler", "robust"], help="build one of the two files")
    p.add_argument("--ruler-jsonl", help="reuse RULER records already generated (JSONL) instead of running RULER")
    p.add_argument("--out-prefix", required=True, help="e.g. elastic_vllm/eval/data/smollm2")


def prepare(a: argparse.Namespace, argv: list[str], log=print) -> dict:
    from transformers import AutoTokenizer

    from elastic_vllm.eval.baselines import calibration_prompts
    from elastic_vllm.eval.robust import essay_text, generate_robust

    prefix = Path(a.out_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    man_path = Path(f"{prefix}_manifest.json")
    manifest = json.loads(man_path.read_text()) if man_path.is_file() else {}
    files = manifest.setdefault("files", {})
    command = " ".join(shlex.quote(x) for x in argv)
    if a.only != "robust":
        t0 = time.perf_counter()
        dest = Path(f"{prefix}_ruler.jsonl.xz")
        if a.ruler_jsonl:
            write_jsonl(dest, read_jsonl(a.ruler_jsonl))
        else:
            tmp = Path(f"{prefix}_ruler.partial.jsonl")
            generate_ruler(a.model, a.lengths, a.samples, tmp, tasks=a.tasks, seed=a.seed, log=log)
            write_jsonl(dest, read_jsonl(tmp))
            tmp.unlink()
        extra = {"command": command, "tasks": a.tasks, "samples": a.samples, "seed": a.seed}
        if a.ruler_jsonl:  # records of an earlier generate_ruler run (same arguments), compressed here
            extra["from_jsonl"] = Path(a.ruler_jsonl).name
        files["ruler"] = _describe(dest, extra)
        log(f"{dest}: {files['ruler']['bytes'] / 1e6:.2f} MB ({time.perf_counter() - t0:.0f} s)")
    if a.only != "ruler":
        tok = AutoTokenizer.from_pretrained(a.model)
        counts = {"summ": a.summ, "cont": a.cont, "code": a.code}
        rows = generate_robust(tok, a.lengths, counts, seed=a.seed)
        essays = essay_text()  # calibration haystacks from the second half (RULER's essay haystack is the start)
        rows += calibration_prompts(tok, essays[len(essays) // 2 :], a.lengths, a.calib, seed=a.seed + 1000)
        dest = Path(f"{prefix}_robust.jsonl.xz")
        write_jsonl(dest, rows)
        files["robust"] = _describe(
            dest,
            {
                "command": command,
                "tasks": list(ROBUST_TASKS),
                "samples": counts,
                "calib": a.calib,
                "seed": a.seed,
                "stdlib_python": platform.python_version(),
            },
        )
        log(f"{dest}: {files['robust']['bytes'] / 1e6:.2f} MB")
    manifest.pop("command", None)  # per file now
    manifest.update(
        {
            "lengths": a.lengths,
            "tokenizer": Path(a.model).name,
            "generator": PACKAGE_REQ,
            "prompt_format": "chat template (one user turn) + RULER answer prefix opening the assistant turn",
        }
    )
    man_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _describe(path: Path, extra: dict) -> dict:
    rows = read_jsonl(path)
    counts: dict[str, int] = {}
    for r in rows:
        k = f"{r['task']}@{r['length']}"
        counts[k] = counts.get(k, 0) + 1
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path), "records": counts, **extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m elastic_vllm.eval.prepare", description=__doc__.split("\n\n")[0])
    add_args(p)
    argv = sys.argv[1:] if argv is None else argv
    prepare(p.parse_args(argv), ["python3", "-m", "elastic_vllm.eval.prepare", *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
