import pytest
from pydantic import ValidationError

from elastic_vllm.config import ConfigError, ElasticConfig, HeadMode


def test_defaults_are_paper_defaults():
    c = ElasticConfig()
    assert (c.mode, c.sink, c.window, c.xattn_stride, c.xattn_block) == ("FA-SSA", 128, 2048, 16, 128)
    assert c.xattn_threshold == 0.9 and c.pooling == "boundary" and c.pool_tokens == 100
    assert c.decode_mode == "dense" and c.force == "auto"


@pytest.mark.parametrize(
    "mode,fa,sa",
    [("FA-SSA", HeadMode.FA, HeadMode.SSA), ("FA-XA", HeadMode.FA, HeadMode.XA), ("XA-SSA", HeadMode.XA, HeadMode.SSA)],
)
def test_mode_maps_to_head_modes(mode, fa, sa):
    c = ElasticConfig(mode=mode)
    assert (c.fa_mode, c.sa_mode) == (fa, sa)
    assert c.uses_xattn == (mode != "FA-SSA")


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"window": 0}, "elastic.window"),
        ({"sink": -1}, "elastic.sink"),
        ({"mode": "SA-FA"}, "elastic.mode"),
        ({"decode_mode": "fast"}, "elastic.decode_mode"),
        ({"force": "all-fa"}, "elastic.force"),
        ({"pooling": "middle"}, "elastic.pooling"),
        ({"xattn_threshold": 1.5}, "elastic.xattn_threshold"),
        ({"windw": 512}, "elastic.windw"),
        ({"xattn_block": 100, "xattn_stride": 16}, "xattn_block"),
    ],
)
def test_errors_name_the_field(raw, field):
    with pytest.raises(ConfigError) as e:
        ElasticConfig.parse(raw)
    assert field in str(e.value)


def test_parse_json_and_not_object():
    assert ElasticConfig.parse('{"window": 512}').window == 512
    with pytest.raises(ConfigError, match="not valid JSON"):
        ElasticConfig.parse("{window: 512")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ElasticConfig.parse([1, 2])


def test_frozen():
    c = ElasticConfig()
    with pytest.raises(ValidationError, match="frozen"):
        c.window = 5


def test_chunk_routing_field():
    assert ElasticConfig().chunk_routing == "prefix"
    assert ElasticConfig.parse({"chunk_routing": "dense"}).chunk_routing == "dense"
    with pytest.raises(ConfigError, match=r"elastic\.chunk_routing"):
        ElasticConfig.parse({"chunk_routing": "suffix"})
