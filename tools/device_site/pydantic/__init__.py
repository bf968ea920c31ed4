"""A stand-in for pydantic on the GPU machine's image, which has none (torch, triton, transformers, no vLLM until
it is staged): enough for ``elastic_vllm.config`` to import, so that the kernel checks and benchmarks reach
``HeadMode`` and the references. It validates nothing. ``tools/gpu_session.sh`` puts this folder LAST on
PYTHONPATH: the real pydantic of a staged vLLM comes first."""

from typing import ClassVar


class BaseModel:
    model_fields: ClassVar[dict] = {}

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class ValidationError(ValueError):
    pass


ConfigDict = dict


def Field(default=None, **kw):
    return default


def model_validator(**kw):
    return lambda f: f


def field_validator(*a, **kw):
    return lambda f: f


class ValidationInfo:
    """Annotation only: the validators that take it never run here."""
