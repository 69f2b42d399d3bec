"""The base of every configuration section, and the patterns several sections check."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

ENV_PREFIX = "ASYNCINFER_"
SHA256_HEX_PATTERN = re.compile(r"^[0-9a-f]{64}$")
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
