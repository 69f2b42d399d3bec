"""docs/ARCHITECTURE.md's contract tables and asyncinfer.contract agree: every name a table lists
exists in the module with the value the table shows, and every name the module defines is listed.
Also: the NatsConfig defaults are the contract's, and NATS's own header names are spelled as
nats-py spells them."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from nats.js import api
from nats.js.kv import KV_MARKER_REASON, KV_OP

from asyncinfer import contract
from asyncinfer.config import NatsConfig

ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"
CODE_SPAN = re.compile(r"`([^`]+)`")
# A hash in a key (claim_key, disabled_url_key) is shown as <sha256>.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def contract_section() -> str:
    text = ARCHITECTURE.read_text()
    start = text.index("\n## The contract\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def documented_rows() -> dict[str, str]:
    """{name in the first column: the first code span of the second column} of every table of the
    contract whose first column is headed "name in `asyncinfer.contract`"."""
    rows: dict[str, str] = {}
    in_contract_table = False
    for line in contract_section().splitlines():
        if not line.startswith("|"):
            in_contract_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "name in `asyncinfer.contract`":
            in_contract_table = True
            continue
        if not in_contract_table or set(cells[0]) <= {"-", ":"}:
            continue
        (name,) = CODE_SPAN.findall(cells[0])
        values = CODE_SPAN.findall(cells[1])
        # A function of several subjects shows each; anything else shows its one value first.
        rows[name] = ", ".join(values) if name in LISTED else (values[0] if values else "")
    return rows


# Contract functions that return a list of subjects, all of them shown in the table.
LISTED = {"work_filters"}


def defined_names() -> set[str]:
    """The public constants and functions asyncinfer.contract defines (not the ones it imports)."""
    names = set()
    for name, value in vars(contract).items():
        if name.startswith("_"):
            continue
        if (inspect.isfunction(value) and value.__module__ == contract.__name__) or (
            name.isupper() and isinstance(value, str)
        ):
            names.add(name)
    return names


class _PlaceholderPriority:
    """Stands for a Priority where a table shows `<priority>`."""

    subject_token = "<priority>"
    value = "<PRIORITY>"


def with_placeholders(function: Any) -> Any:
    """The function called with each parameter as its placeholder, `<parameter name>`."""
    arguments = {
        name: _PlaceholderPriority() if name == "priority" else f"<{name}>"
        for name in inspect.signature(function).parameters
    }
    return function(**arguments)


def test_the_tables_list_every_contract_name_and_only_those() -> None:
    documented = set(documented_rows())
    assert documented, "no contract tables found in docs/ARCHITECTURE.md"
    assert documented - defined_names() == set(), "documented but not in asyncinfer.contract"
    assert defined_names() - documented == set(), "in asyncinfer.contract but not documented"


@pytest.mark.parametrize(("name", "shown"), sorted(documented_rows().items()))
def test_each_documented_value_is_the_contracts(name: str, shown: str) -> None:
    value = getattr(contract, name)
    if isinstance(value, str):
        assert shown == value
        return
    result = with_placeholders(value)
    if name in LISTED:
        result = ", ".join(result)
    if isinstance(result, str):
        assert SHA256_HEX.sub("<sha256>", result) == shown
    else:  # routing_headers: every header it sets is a documented header
        headers = {getattr(contract, n) for n in documented_rows() if n.endswith("_HEADER")}
        assert set(result) <= headers


CONTRACT_SHAPED = re.compile(
    r"^(?:[a-z_]+_(?:subject|subjects|subject_prefix|key|keys|name|stream|msg_id|headers)"
    r"|[A-Z_]+_(?:HEADER|STREAM|BUCKET|PREFIX|SUBJECTS|CONSUMER))$"
)


def test_every_contract_shaped_name_the_section_mentions_exists() -> None:
    """Names the prose and the other columns mention (`WORK_SUBJECTS` in the streams table,
    `job_key` in the buckets table) are contract names too."""
    mentioned = {span for span in CODE_SPAN.findall(contract_section()) if CONTRACT_SHAPED.match(span)}
    assert {"WORK_SUBJECTS", "job_key", "dead_letter_msg_id"} <= mentioned
    assert {name for name in mentioned if not hasattr(contract, name)} == set()


def test_the_config_defaults_are_the_contracts() -> None:
    config = NatsConfig()
    assert config.work_stream == contract.WORK_STREAM
    assert config.dead_letter_stream == contract.DEAD_LETTER_STREAM
    assert config.webhooks_stream == contract.WEBHOOKS_STREAM
    assert config.jobs_bucket == contract.JOBS_BUCKET
    assert config.queues_bucket == contract.QUEUES_BUCKET
    assert config.idempotency_bucket == contract.IDEMPOTENCY_BUCKET
    assert config.webhooks_bucket == contract.WEBHOOKS_BUCKET
    assert config.objects_bucket == contract.OBJECTS_BUCKET
    assert config.models_bucket == contract.MODELS_BUCKET
    assert config.batches_bucket == contract.BATCHES_BUCKET


def test_the_config_keys_in_the_streams_table_exist() -> None:
    keys = re.findall(r"`nats\.([a-z_]+)`", contract_section())
    assert len(keys) == 10
    for key in keys:
        assert key in NatsConfig.model_fields, key


def test_nats_header_names_are_the_ones_nats_py_uses() -> None:
    assert api.Header.EXPECTED_STREAM.value == contract.EXPECTED_STREAM_HEADER
    assert api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value == contract.EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER
    assert api.Header.MSG_TTL.value == contract.MSG_TTL_HEADER
    assert api.Header.MSG_ID.value == contract.MSG_ID_HEADER
    assert api.Header.ROLLUP.value == contract.ROLLUP_HEADER
    assert contract.KV_OPERATION_HEADER == KV_OP
    assert contract.MARKER_REASON_HEADER == KV_MARKER_REASON


def test_the_sequence_diagram_covers_every_hop() -> None:
    """The job's path in the diagram names each step the brief of the diagram promises."""
    text = ARCHITECTURE.read_text()
    diagram = text[text.index("```mermaid") : text.index("```", text.index("```mermaid") + 3)]
    assert diagram.startswith("```mermaid\nsequenceDiagram")
    for step in (
        "SubmitJob",
        "claim",
        "admission",
        "publish envelope",
        "create job_key",
        "queued notice",
        "pull",
        "RUNNING",
        "WorkOrder",
        "dynamic batching",
        "WorkResult",
        "SUCCEEDED",
        "ack",
        "WatchJob",
        "webhook",
    ):
        assert step in diagram, step
