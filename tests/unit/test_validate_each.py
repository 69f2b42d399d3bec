"""Validating a SubmitJobs message's requests together (services.gateway.submit_request.validate_each):
the same answer for each request as validate_submit alone, in order, each (model, version) resolved
once for the message."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, InvalidArgument, NotFound
from asyncinfer.tensors import Tensor
from services.gateway.model_catalog import ModelCatalog
from services.gateway.submit_request import SubmitRequest, validate_each, validate_submit

pytestmark = pytest.mark.unit


def request(model_name: str = "demo", columns: int = 4, **fields: object) -> SubmitRequest:
    x = Tensor.from_numpy("x", np.zeros((1, columns), dtype=np.float32))
    return SubmitRequest(model_name=model_name, inputs=(x,), **fields)  # type: ignore[arg-type]


def outcome(request: SubmitRequest, config: Config, now: float) -> object:
    try:
        return validate_submit(request, config, now=now)
    except AsyncInferError as error:
        return type(error), error.reason, str(error)


class CountingCatalog(ModelCatalog):
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.resolved: list[tuple[str, str]] = []

    def resolve(self, name: str, version: str) -> object:  # type: ignore[override]
        self.resolved.append((name, version))
        return super().resolve(name, version)


def test_each_request_gets_what_validating_it_alone_gives_and_models_resolve_once() -> None:
    config, now = Config(), time.time()
    requests = [
        request(),
        request(columns=3),  # the wrong shape for demo
        request("no-such-model"),
        request(max_attempts=-1),
        request("no-such-model"),
        request(model_version="9"),  # a version demo does not have
        request(),
    ]
    catalog = CountingCatalog(config)
    checked = validate_each(requests, config, now=now, catalog=catalog)
    assert len(checked) == len(requests)
    for got, alone in zip(checked, (outcome(r, config, now) for r in requests), strict=True):
        if isinstance(got, AsyncInferError):
            assert (type(got), got.reason, str(got)) == alone
        else:
            assert got == alone
    assert isinstance(checked[1], InvalidArgument)
    assert isinstance(checked[2], NotFound)
    assert checked[0] == checked[6]
    assert sorted(catalog.resolved) == [("demo", ""), ("demo", "9"), ("no-such-model", "")]
