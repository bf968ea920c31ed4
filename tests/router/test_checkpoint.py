import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from elastic_vllm.router.checkpoint import (
    BackboneMeta,
    BackboneShape,
    RouterCheckpointError,
    RouterMeta,
    load_router,
    save_router,
)
from elastic_vllm.router.convert import convert_authors_checkpoint
from elastic_vllm.router.model import ElasticRouter


def _meta(L=3, H=2, d=16, **kw):
    return RouterMeta(
        backbone=BackboneMeta(id="tiny", model_type="llama", num_layers=L, num_kv_heads=H, head_dim=d),
        attention={"mode": "FA-SSA", "sink": 4, "window": 8},
        **kw,
    )


def test_round_trip(tmp_path):
    r = ElasticRouter(3, 16)
    save_router(r, tmp_path / "ck", _meta(training={"steps": 7}))
    ck = load_router(tmp_path / "ck", expect=BackboneShape(num_layers=3, num_kv_heads=2, head_dim=16))
    for (k, a), (_, b) in zip(r.state_dict().items(), ck.router.state_dict().items()):
        assert torch.equal(a, b), k
    assert ck.meta.training == {"steps": 7} and ck.meta.attention["window"] == 8
    x = torch.randn(4, 2, 16)
    torch.testing.assert_close(ck.router(2, x), r(2, x))
    assert len(ck.meta.sha256) == 64


@pytest.mark.parametrize(
    "shape,needle",
    [
        (BackboneShape(num_layers=4, num_kv_heads=2, head_dim=16), "num_layers: router 3 vs model 4"),
        (BackboneShape(num_layers=3, num_kv_heads=8, head_dim=16), "num_kv_heads: router 2 vs model 8"),
        (BackboneShape(num_layers=3, num_kv_heads=2, head_dim=128), "head_dim: router 16 vs model 128"),
    ],
)
def test_mismatch_names_both_shapes(tmp_path, shape, needle):
    save_router(ElasticRouter(3, 16), tmp_path, _meta())
    with pytest.raises(RouterCheckpointError) as e:
        load_router(tmp_path, expect=shape, model_name="my-model")
    msg = str(e.value)
    assert needle in msg and "layers=3, kv_heads=2, head_dim=16" in msg and shape.describe() in msg
    assert "my-model" in msg


def test_truncated_file(tmp_path):
    save_router(ElasticRouter(2, 16), tmp_path, _meta(L=2))
    w = tmp_path / "router.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(RouterCheckpointError, match="truncated or corrupted"):
        load_router(tmp_path)


def test_truncated_file_without_recorded_digest(tmp_path):
    save_router(ElasticRouter(2, 16), tmp_path, _meta(L=2))
    m = json.loads((tmp_path / "router.json").read_text())
    m["sha256"] = ""
    (tmp_path / "router.json").write_text(json.dumps(m))
    w = tmp_path / "router.safetensors"
    w.write_bytes(w.read_bytes()[:50])
    with pytest.raises(RouterCheckpointError, match="truncated or corrupted"):
        load_router(tmp_path)


def test_bad_metadata(tmp_path):
    save_router(ElasticRouter(2, 16), tmp_path, _meta(L=2))
    (tmp_path / "router.json").write_text("{not json")
    with pytest.raises(RouterCheckpointError, match="not valid JSON"):
        load_router(tmp_path)
    (tmp_path / "router.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(RouterCheckpointError, match="not an elastic-vllm router"):
        load_router(tmp_path)
    with pytest.raises(RouterCheckpointError, match="is not a folder"):
        load_router(tmp_path / "missing")
    (tmp_path / "router.json").unlink()
    with pytest.raises(RouterCheckpointError, match=r"has no router\.json"):
        load_router(tmp_path)


def test_nan_weights_rejected(tmp_path):
    r = ElasticRouter(1, 8)
    with torch.no_grad():
        r.layers[0].cls_router_head_agnostic[4].bias[0] = float("nan")
    save_router(r, tmp_path, _meta(L=1, d=8))
    with pytest.raises(RouterCheckpointError, match="NaN"):
        load_router(tmp_path)


def _authors_checkpoint(folder, L=2, d=16, H=2, shards=2):
    """A synthetic full-model checkpoint named as the authors name theirs."""
    folder.mkdir()
    ref = ElasticRouter(L, d)
    tensors = {}
    for k, v in ref.state_dict().items():
        tensors[k.replace("layers.", "model.layers.", 1).replace(".cls_", ".self_attn.mask_allocator.cls_")] = v
    for i in range(L):  # training state and backbone weights the converter must skip
        tensors[f"model.layers.{i}.self_attn.mask_allocator.log_temp"] = torch.zeros(1)
        tensors[f"model.layers.{i}.self_attn.mask_allocator.attn_mask_log_alphas"] = torch.zeros(H, 2)
        tensors[f"model.layers.{i}.self_attn.mask_allocator.sparsity_lambda_1"] = torch.zeros(1)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.randn(H * d, 64)
    names = sorted(tensors)
    for s in range(shards):
        save_file(
            {n: tensors[n].contiguous() for n in names[s::shards]}, str(folder / f"model-0000{s + 1}.safetensors")
        )
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": L,
        "num_attention_heads": 4 * H,
        "num_key_value_heads": H,
        "head_dim": d,
        "toggle_type": "streaming",
        "sink_size": 128,
        "local_window_size": 2048,
        "pooling_mode": "first_last_100",
        "use_softmax": True,
        "block_size": 128,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return ref


def test_converter_on_authors_naming(tmp_path):
    ref = _authors_checkpoint(tmp_path / "authors")
    out = convert_authors_checkpoint(tmp_path / "authors", tmp_path / "ours", backbone_id="Qwen3-test")
    ck = load_router(out, expect=BackboneShape(num_layers=2, num_kv_heads=2, head_dim=16))
    x = torch.randn(3, 2, 16)
    for layer in range(2):
        torch.testing.assert_close(ck.router(layer, x), ref(layer, x))
    a = ck.meta.attention
    assert (a["mode"], a["sink"], a["window"]) == ("FA-SSA", 128, 2048)
    assert a["authors_config"]["pooling_mode"] == "first_last_100"
    assert ck.meta.backbone.id == "Qwen3-test" and ck.meta.backbone.model_type == "qwen3"


def test_converter_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RouterCheckpointError, match=r"no config\.json"):
        convert_authors_checkpoint(tmp_path / "empty", tmp_path / "o")
    (tmp_path / "empty" / "config.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "empty" / "model.safetensors"))
    with pytest.raises(RouterCheckpointError, match="no router tensors"):
        convert_authors_checkpoint(tmp_path / "empty", tmp_path / "o")
    # a layer count in config.json that the tensors do not match: named, before a router is sized by it (2**40
    # used to allocate a router of 2**40 layers)
    src = tmp_path / "a"
    _authors_checkpoint(src, L=2)
    cfg = json.loads((src / "config.json").read_text())
    for n in (2**40, 3, 1):
        (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))
        msg = _fails_cleanly_in_bounded_memory("convert_authors_checkpoint(sys.argv[1], sys.argv[2])", str(src),
                                               str(tmp_path / "o"))  # fmt: skip
        assert f"num_hidden_layers={n}, but" in msg and "tensors for 2 layers" in msg, msg


def test_cli_convert(tmp_path, capsys):
    from elastic_vllm.cli import main

    _authors_checkpoint(tmp_path / "a")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "o")]) == 0
    assert json.loads(capsys.readouterr().out)["backbone"]["num_layers"] == 2
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_expected_shapes_match_the_module():
    from elastic_vllm.router.checkpoint import expected_shapes

    r = ElasticRouter(3, 16, 2)
    assert expected_shapes(3, 16, 2) == {k: tuple(v.shape) for k, v in r.state_dict().items()}


def test_huge_metadata_shape_fails_cleanly(tmp_path):
    save_router(ElasticRouter(2, 16), tmp_path, _meta(L=2))
    m = json.loads((tmp_path / "router.json").read_text())
    m["backbone"]["head_dim"] = 2**40
    (tmp_path / "router.json").write_text(json.dumps(m))
    with pytest.raises(RouterCheckpointError, match="expected"):
        load_router(tmp_path)


LIMITED = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
    "from elastic_vllm.router.checkpoint import RouterCheckpointError, load_router\n"
    "from elastic_vllm.router.convert import convert_authors_checkpoint\n"
    "try:\n"
    "    {call}\n"
    "except RouterCheckpointError as e:\n"
    "    print(e)\n"
    "    sys.exit(3)\n"
)


def _fails_cleanly_in_bounded_memory(call: str, *args: str) -> str:
    """Run ``call`` in a subprocess under a 6 GiB address-space limit (a regression that sizes something by a
    corrupted count fails with MemoryError instead of taking the machine down); it must raise
    RouterCheckpointError. Returns the error's message."""
    r = subprocess.run([sys.executable, "-c", LIMITED.format(call=call), *args], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 3, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("n_layers", [2**40, 3, 1])
def test_metadata_layer_count_is_checked_against_the_file_first(tmp_path, n_layers):
    """A router.json claiming more (or fewer) layers than the file holds fails by name, before anything is sized
    by that count: 2**40 layers used to enumerate 10 * 2**40 expected tensor names and ran out of memory (found
    by test_fuzz's metadata fuzzing)."""
    save_router(ElasticRouter(2, 16), tmp_path, _meta(L=2))
    m = json.loads((tmp_path / "router.json").read_text())
    m["backbone"]["num_layers"] = n_layers
    (tmp_path / "router.json").write_text(json.dumps(m))
    msg = _fails_cleanly_in_bounded_memory("load_router(sys.argv[1])", str(tmp_path))
    assert f"num_layers={n_layers}" in msg and "tensors for 2 layers" in msg, msg


def test_input_norm_round_trip_and_effect(tmp_path):
    """The router's per-(layer, KV head) input standardization is saved, loaded and applied."""
    torch.manual_seed(0)
    r = ElasticRouter(3, 16)
    shift, scale = torch.randn(3, 2, 16) * 5, torch.rand(3, 2, 16) + 0.5
    r.set_input_norm(shift, scale)
    save_router(r, tmp_path / "ck", _meta())
    ck = load_router(tmp_path / "ck", expect=BackboneShape(num_layers=3, num_kv_heads=2, head_dim=16))
    x = torch.randn(4, 2, 16)
    want = r.layers[1]((x - shift[1]) * scale[1])
    torch.testing.assert_close(ck.router(1, x), want)
    assert not torch.allclose(ck.router(1, x), r.layers[1](x))  # the norm changes the logits
    with pytest.raises(ValueError, match="KV heads"):
        ck.router(1, torch.randn(4, 3, 16))


@pytest.mark.parametrize("case", ["one-tensor", "bad-shape", "non-positive-scale"])
def test_input_norm_errors(tmp_path, case):
    from safetensors.torch import load_file

    r = ElasticRouter(3, 16)
    r.set_input_norm(torch.zeros(3, 2, 16), torch.ones(3, 2, 16))
    save_router(r, tmp_path, _meta())
    t = load_file(str(tmp_path / "router.safetensors"))
    if case == "one-tensor":
        del t["input_scale"]
        match = "missing"
    elif case == "bad-shape":
        t["input_shift"] = torch.zeros(3, 4, 16)
        match = "input_shift has shape"
    else:
        t["input_scale"][0, 0, 0] = 0.0
        match = "input_scale has values <= 0"
    save_file(t, str(tmp_path / "router.safetensors"), metadata={"format": "elastic-vllm-router"})
    meta = json.loads((tmp_path / "router.json").read_text())
    meta["sha256"] = ""
    (tmp_path / "router.json").write_text(json.dumps(meta))
    with pytest.raises(RouterCheckpointError, match=match):
        load_router(tmp_path)


def test_half_precision_storage_keeps_norm_in_float32(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    r = ElasticRouter(3, 16)
    r.set_input_norm(torch.randn(3, 2, 16) * 10, torch.rand(3, 2, 16) + 0.5)
    save_router(r, tmp_path, _meta(), weights_dtype=torch.float16)
    t = load_file(str(tmp_path / "router.safetensors"))
    assert t["input_shift"].dtype == torch.float32 and t["layers.0.cls_feat_extractor.0.weight"].dtype == torch.float16
    ck = load_router(tmp_path)
    x = torch.randn(4, 2, 16) * 10
    torch.testing.assert_close(ck.router(1, x), r(1, x), atol=5e-2, rtol=1e-2)
