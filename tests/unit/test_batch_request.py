"""The SDK's CreateBatch request: a batch's webhook is given as `submit`'s is (`callback`, a URL or
a Callback), or as `callback_url`; `create_batch(callback=...)` was a TypeError."""

from __future__ import annotations

import pytest

from asyncinfer.client import Callback
from asyncinfer.client.batches import create_batch_request

pytestmark = pytest.mark.unit


def test_a_batch_callback_is_given_as_a_jobs_is() -> None:
    hook = "https://example.com/hook"
    assert create_batch_request("ref", "demo", callback=hook).callback.url == hook
    assert create_batch_request("ref", "demo", callback=Callback(hook)).callback.url == hook
    assert create_batch_request("ref", "demo", callback_url=hook).callback.url == hook
    assert not create_batch_request("ref", "demo").HasField("callback")
    with pytest.raises(ValueError, match="not both"):
        create_batch_request("ref", "demo", callback=hook, callback_url=hook)
