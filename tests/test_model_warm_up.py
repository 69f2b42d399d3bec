"""A model's `warm_up` setting: a newly loaded version computes one batch of made-up inputs before
it takes work (Triton's model_warmup), unless its table says false; on the real stack, with a
model that counts the batches it computes."""

from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.client import AsyncClient
from asyncinfer.config import DEMO_MODEL, Config
from services.batcher.models import demo
from tests.stack import StartStack

COUNTING = DEMO_MODEL.model_copy(
    update={"name": "counting", "loader": "services.batcher.models.demo:build_counting_model"}
)
X = {"x": np.ones((2, 4), np.float32)}


@pytest.mark.parametrize("warm_up", [True, False])
async def test_a_version_warms_up_before_its_first_job_unless_told_not_to(
    config: Config, start_stack: StartStack, warm_up: bool
) -> None:
    demo.COUNTED_BATCHES.clear()
    stack = await start_stack(config.replace(models=(COUNTING.model_copy(update={"warm_up": warm_up}),)))
    # Started: the warm-up, when there is one, ran before the batcher took work.
    assert ([1] if warm_up else []) == demo.COUNTED_BATCHES
    async with AsyncClient(stack.address) as client:
        done = await client.wait(await client.submit("counting", X), timeout_s=30)
    assert done.state.name == "SUCCEEDED", done
    assert demo.COUNTED_BATCHES[-1] == 2  # the job's two rows
    assert len(demo.COUNTED_BATCHES) == (2 if warm_up else 1)
