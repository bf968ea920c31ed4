"""Fuzzing (hypothesis) of the config parser and the router checkpoint loader: any input either
parses to a valid config / router or raises the project's own error with a message."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_vllm.config import ConfigError, ElasticConfig
from elastic_vllm.router.checkpoint import BackboneMeta, RouterCheckpointError, RouterMeta, load_router, save_router
from elastic_vllm.router.model import ElasticRouter

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
field_names = st.sampled_from([*ElasticConfig.model_fields, "bogus", ""])
configs = st.dictionaries(field_names, json_values, max_size=5)


@settings(max_examples=300, deadline=None)
@given(configs)
def test_config_parser_never_crashes(raw):
    try:
        cfg = ElasticConfig.parse(raw)
    except ConfigError as e:
        msg = str(e)
        assert msg.startswith("invalid elastic config:") and "elastic" in msg[len("invalid elastic config:") :]
        return
    assert cfg.window >= 1 and cfg.sink >= 0 and 0 < cfg.xattn_threshold <= 1
    assert cfg.xattn_block % cfg.xattn_stride == 0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_config_parser_on_arbitrary_strings(s):
    try:
        ElasticConfig.parse(s)
    except ConfigError:
        pass


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    meta = RouterMeta(backbone=BackboneMeta(id="t", num_layers=2, num_kv_heads=2, head_dim=8))
    save_router(ElasticRouter(2, 8), d, meta)
    return (d / "router.safetensors").read_bytes(), json.loads((d / "router.json").read_text())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_loader_on_corrupted_weights(tmp_path_factory, good_checkpoint, data):
    weights, meta = good_checkpoint
    d = tmp_path_factory.mktemp("fz")
    blob = bytearray(weights)
    op = data.draw(st.sampled_from(["flip", "truncate", "header", "garbage"]))
    if op == "flip":
        for i in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=8)):
            blob[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif op == "header":
        blob[:8] = data.draw(st.binary(min_size=8, max_size=8))
    else:
        blob = bytearray(data.draw(st.binary(max_size=200)))
    (d / "router.safetensors").write_bytes(bytes(blob))
    check_digest = data.draw(st.booleans())
    (d / "router.json").write_text(json.dumps({**meta, "sha256": meta["sha256"] if check_digest else ""}))
    try:
        ck = load_router(d)
    except RouterCheckpointError as e:
        assert str(d) in str(e)
        return
    # survived: only possible without the digest check, and then every weight must be finite
    assert not check_digest or bytes(blob) == weights
    assert all(torch.isfinite(p).all() for p in ck.router.parameters())


backbone_patch = st.dictionaries(
    st.sampled_from(["id", "num_layers", "num_kv_heads", "head_dim", "model_type"]), json_values
)
router_patch = st.dictionaries(st.sampled_from(["hidden_mult", "dtype"]), json_values)
meta_patch = st.fixed_dictionaries(
    {},
    optional={
        "format": json_values,
        "format_version": json_values,
        "backbone": backbone_patch | json_values,
        "router": router_patch | json_values,
        "pooling": json_values,
        "sha256": json_values,
        "x": json_values,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta_patch)
def test_loader_on_fuzzed_metadata(tmp_path_factory, good_checkpoint, patch):
    weights, meta = good_checkpoint
    d = tmp_path_factory.mktemp("fm")
    (d / "router.safetensors").write_bytes(weights)
    merged = {**meta, **patch}
    for k in ("backbone", "router"):
        if isinstance(patch.get(k), dict) and isinstance(meta.get(k), dict):
            merged[k] = {**meta[k], **patch[k]}
    (d / "router.json").write_text(json.dumps(merged))
    try:
        load_router(d)
    except RouterCheckpointError:
        pass
