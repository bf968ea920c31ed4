"""The GPU tests' parts that run on the CPU, so that a typo does not cost a GPU session: test_gpu_tp.py's pure parts
(tiny shapes: the random-weight Llama writer (loads in transformers, reproducible), the mixed-decision router, the
assembly of the ranks' routing events, the evaluation of every check on synthetic step records), and
test_gpu_kernels.py's cases at toy sizes under the Triton interpreter (``--cpu-dry``), with the JSON rows the GPU
session brings back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("gpu_tp_under_test", GPU_DIR / "test_gpu_tp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DIMS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
    head_dim=8, vocab_size=50,
)  # fmt: skip


def test_random_llama_loads_in_transformers_and_is_reproducible(ct, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    a = ct.write_random_llama(tmp_path / "a", DIMS, device="cpu", dtype="float32", max_positions=256)
    b = ct.write_random_llama(tmp_path / "b", DIMS, device="cpu", dtype="float32", max_positions=256)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert wa["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert wa["lm_head.weight"].std().item() == pytest.approx(0.06, rel=0.1)
    assert torch.equal(wa["model.norm.weight"], torch.ones(64))
    model, info = LlamaForCausalLM.from_pretrained(str(a), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = model.config
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rope_parameters["rope_type"]) == (4, 8, "llama3")
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    bf16 = ct.write_random_llama(tmp_path / "c", DIMS, device="cpu", dtype="bfloat16")
    assert load_file(str(bf16 / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16


def test_dense_forward_keys_equal_transformers(ct, tmp_path):
    """The calibration forward's pooled pre-RoPE keys == transformers' k_proj outputs, pooled the same way
    (layers past 0 check its attention with llama3 RoPE and its MLP)."""
    from transformers import LlamaForCausalLM

    from elastic_vllm.router.model import pool_keys

    weights = ct.random_llama_weights(DIMS, device="cpu", dtype="float32", std=0.1)
    ct.save_llama(tmp_path / "m", weights, DIMS, "float32", max_positions=512)
    prompts = ct.prompt_ids([40, 300], DIMS["vocab_size"])
    got = ct.dense_prerope_pooled(weights, DIMS, prompts, pool_tokens=16)
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32, attn_implementation="eager")
    keys = {}

    def hook(i):
        return lambda _m, _i, out: keys.__setitem__(i, out[0])

    for n, ids in enumerate(prompts):
        hooks = [layer.self_attn.k_proj.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        want = torch.stack([pool_keys(keys[i].view(len(ids), 4, 8), "boundary", 16) for i in range(2)])
        torch.testing.assert_close(got[n], want, atol=1e-4, rtol=1e-4)


def test_router_decisions_are_mixed(ct, tmp_path):
    from elastic_vllm.router.checkpoint import load_router
    from elastic_vllm.router.model import decide

    pooled = 0.01 * torch.randn(4, 4, 8, 16, generator=torch.Generator().manual_seed(1)) + 3.0  # [N, L, H, D]
    path = ct.write_router(tmp_path / "r", num_layers=4, num_kv_heads=8, head_dim=16, pooled=pooled)
    ck = load_router(path)
    assert ck.meta.shape.num_kv_heads == 8 and ck.router.num_layers == 4
    logits = torch.stack([ck.router(layer, pooled[:, layer]) for layer in range(4)])  # [L, N, H, 2]
    margin = logits[..., 1] - logits[..., 0]
    # calibrated per layer: margins of std 1 around the median, however small and offset the keys are
    assert torch.allclose(margin.flatten(1).std(dim=1), torch.ones(4), atol=1e-3)
    share = decide(logits).float().mean(dim=(1, 2))
    assert ((share >= 0.4) & (share <= 0.6)).all(), share
    uncalibrated = ct.router_rules(4, 16)
    assert all(abs(float(w.norm()) - 1) < 1e-6 and c == 0.0 for w, c in uncalibrated.values())


def test_prompts(ct):
    assert ct.prompt_lengths(1024, 6000) == [1024, 2683, 4341, 6000]
    ids = ct.prompt_ids([5, 9], vocab=50)
    assert [len(x) for x in ids] == [5, 9] and all(3 <= t < 50 for x in ids for t in x)
    assert ids == ct.prompt_ids([5, 9], vocab=50)


def _event(rid, rank, heads, dec, logits, msr_all):
    return dict(req_id=rid, tp_rank=rank, kv_heads=heads, decisions=dec, logits=logits, omega_msr_all=msr_all)


def _logits(dec, margin=1.0):
    return [[[0.0, margin] if d else [margin, 0.0] for d in row] for row in dec]


def _records(ct, flip_tie=False, flip_sure=False, msr_count=2.0, heads_total=32.0):
    """Step records of a 2-request run: 2 layers x 8 KV heads, TP=2 splits them 4 + 4."""
    dims = {"num_key_value_heads": 8, "num_hidden_layers": 2}
    dec = {r: [[(h + layer + i) % 3 == 0 for h in range(8)] for layer in range(2)] for i, r in enumerate(("0", "1"))}
    tp1 = [_event(f"{r}-0123abcd", 0, list(range(8)), d, _logits(d), 0.0) for r, d in dec.items()]
    dec2 = {r: [row[:] for row in d] for r, d in dec.items()}
    logits2 = {r: _logits(d) for r, d in dec2.items()}
    if flip_tie:  # a near tie (margin 0.01) decided the other way at TP=2
        dec2["0"][1][5] = not dec2["0"][1][5]
        logits2["0"][1][5] = [0.0, 0.01] if dec2["0"][1][5] else [0.01, 0.0]
        tp1[0]["logits"][1][5] = [0.0, 0.01] if dec["0"][1][5] else [0.01, 0.0]
    if flip_sure:
        dec2["1"][0][2] = not dec2["1"][0][2]
    msr2 = {r: ct.omega_msr_of(d) for r, d in dec2.items()}
    tp2 = [
        [
            _event(
                f"{r}-fedcba98",
                rank,
                list(range(4 * rank, 4 * rank + 4)),
                [row[4 * rank : 4 * rank + 4] for row in d],
                [row[4 * rank : 4 * rank + 4] for row in logits2[r]],
                msr2[r],
            )
            for r, d in dec2.items()
        ]
        for rank in range(2)
    ]
    lps = [{"5": -0.1, "9": -3.0}, {"6": -0.2, "7": -4.0}]
    outs = [{"request_id": r, "token_ids": [5, 6], "logprobs": lps} for r in dec]
    metrics = {
        "elastic:request_omega_msr_count": msr_count,
        "elastic:request_omega_msr_sum": sum(msr2.values()),
        "elastic:request_omega_esr_count": 2.0,
        "elastic:head_decisions_total": heads_total,
    }
    return {
        "build": {"dims": dims},
        "tp1": {"events": [tp1], "auto": outs, "ref": outs},
        "tp2_elastic": {"events": tp2, "auto": outs, "all_fa": outs, "metrics": metrics, "graphs": {}},
        "tp2_flash": {"ref": outs, "backend": "FLASH_ATTN"},
    }


def test_eval_routing_and_metrics(ct):
    ok, info = ct.eval_routing(_records(ct))
    assert ok, info
    assert info["rank_kv_heads"] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]] and info["mismatches"] == 0
    ok, info = ct.eval_routing(_records(ct, flip_tie=True))
    assert ok and info["near_tie_flips"] == 1 and info["near_ties_excluded"] == 1
    ok, info = ct.eval_routing(_records(ct, flip_sure=True))
    assert not ok and info["mismatch_at"][1] == [(0, 2)]
    assert ct.eval_metrics(_records(ct))[0]
    assert ct.eval_metrics(_records(ct, flip_tie=True))[0]  # within one flipped head of TP=1's sum
    assert not ct.eval_metrics(_records(ct, msr_count=4.0))[0]  # recorded by both ranks
    assert not ct.eval_metrics(_records(ct, heads_total=48.0))[0]  # a head counted twice


def test_eval_all_fa(ct):
    rec = _records(ct)
    for per_rank in rec["tp2_elastic"]["events"]:
        for e in per_rank:
            e["decisions"] = [[True] * 4 for _ in range(2)]
    ok, info = ct.eval_all_fa(rec)
    assert ok and info["max_logprob_diff"] == 0 and info["positions_compared"] == 4, info
    rec["tp2_elastic"]["all_fa"] = [
        {"request_id": o["request_id"], "token_ids": [5, 7], "logprobs": [{"5": -0.1}, {"7": -0.2}]}
        for o in rec["tp2_elastic"]["all_fa"]
    ]
    ok, info = ct.eval_all_fa(rec)
    assert not ok and info["diverged_before_a_tie"] == [0, 1]


def test_assembly_reports_missing_heads(ct):
    ev = [[_event("a-0123abcd", 0, [0, 1], [[True, False]], [[[0, 1], [1, 0]]], 0.5)]]
    got = ct.assemble_ranks(ev, ["a"], num_kv_heads=4)
    assert got["requests"]["a"]["decisions"] is None and "routed by no rank" in got["problems"][0]
    assert ct.base_request_id("12-0123abcd") == "12" and ct.base_request_id("chat-x") == "chat-x"


def test_metric_sums_and_refusal_message(ct):
    text = (
        "# HELP elastic:head_decisions_total x\n"
        'elastic:head_decisions_total{decision="FA",layer="0",model_name="m",tp_rank="0"} 3.0\n'
        'elastic:head_decisions_total{decision="SA",layer="0",model_name="m",tp_rank="1"} 5.0\n'
        'elastic:request_omega_msr_sum{model_name="m"} 0.25\n'
        "vllm:other 1.0\n"
    )
    assert ct.metric_sums(text) == {"elastic:head_decisions_total": 8.0, "elastic:request_omega_msr_sum": 0.25}
    vllm_msg = "ValueError: Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    assert ct.demo_refusal_ok({"raised": True, "refusal": vllm_msg}) == (True, "")
    assert ct.demo_refusal_ok({"raised": True, "refusal": "elastic: 3 KV heads cannot be split over TP size 2"})[0]
    assert not ct.demo_refusal_ok({"raised": True, "refusal": "AssertionError: "})[0]
    assert not ct.demo_refusal_ok({"raised": False})[0]


def test_plugin_site_declares_the_entry_point(ct, tmp_path):
    site = ct.plugin_site(tmp_path)
    code = (
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='vllm.general_plugins') if e.dist.name == 'elastic-vllm-checkout']\n"
        "eps[0].load()()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum\n"
        "assert AttentionBackendEnum['ELASTIC'] is AttentionBackendEnum.CUSTOM\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(GPU_DIR.parents[1])])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_step_help_runs():
    r = subprocess.run([sys.executable, str(GPU_DIR / "test_gpu_tp.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--step" in r.stdout


def test_kernel_cases_of_the_hf_triton_path_run_dry(tmp_path):
    """test_gpu_kernels.py's cases of the transformers engine's Triton path at toy sizes under the interpreter, run as
    tools/gpu_session.sh runs the GPU tests (tests/gpu/conftest.py alone): the plumbing the GPU run relies on (padded
    prompt and decode step vs the torch path) and the rows it writes."""
    out = tmp_path / "ck.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir", str(GPU_DIR),
         str(GPU_DIR / "test_gpu_kernels.py"), "--cpu-dry", "-k", "hf_triton", "--gpu-out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=GPU_DIR.parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    res = d["results"]
    assert len(res) == 2 and all(r["ok"] and r["err"] <= r["bound"] for r in res), res
    assert d["env"]["git_commit"] and d["env"]["torch"] and len(d["env"]["ops_sha256"]) == 64


def test_gpu_tests_are_skipped_without_a_gpu():
    """Without CUDA and without --cpu-dry every GPU test is skipped, saying why (a hardware gate)."""
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's behaviour")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(GPU_DIR / "test_gpu_kernels.py"),
         str(GPU_DIR / "test_gpu_vllm.py"), "-rs"],
        capture_output=True, text=True, timeout=600, cwd=GPU_DIR.parents[1],
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0 and " passed" not in out and "no CUDA device" in out, out[-3000:]
