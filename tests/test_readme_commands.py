"""Every shell command in README.md, run as it stands against a live `asyncinfer up` (issue 18:
the Operations lines used `$G` and `$S`, defined only in prose, and failed when pasted).

The README's shell blocks (```sh / ```bash / ```shell) are read in order. Each block's first lines
name the addresses (`G=127.0.0.1:50051 ...`, `export ASYNCINFER_GATEWAY_ADDRESS=...`): those lines
alone are changed, to the addresses of the stack this test started (on free ports, so that it
never meets another stack on the defaults); every other line runs verbatim in bash (`set -u`: a
variable the block does not define fails), from a folder whose `.venv` is this interpreter's.
Each command must exit 0, or the code its comment gives (`exits 67`). A grpcurl answer is never
empty (`{}`): answers say what happened.

Placeholders, as the README documents them: `JOB_ID` is the job ID the block's last submit answered;
`SEQ` a sequence the last ListDeadLetters answered. What does not run is named below (NOT_RUN, and
the webhook receiver's URL: CALLBACK_URL). Nothing runs before the README: the stack is `up` as a
newcomer has it (no models in its file, so minilm-l6, minilm-l6-doc and the sample models `demo` and `flaky`; no webhook secret,
so the one `up` generates), and the README's own lines make the dead letter its recipes act on.
The Python SDK example (the ```python block under "The Python SDK") runs too, as it stands but for
its gateway's address, and the console's URL the banner prints answers its first page. No command
writes a Python traceback on stderr: an error is the CLI's line, grpcurl's ERROR block, or nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_up_grpcurl import UpProcess, close, start_up, stop

from asyncinfer.embedded_nats import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELLS = frozenset({"sh", "bash", "shell"})
# The README's default addresses, by port: what each variable line names is moved to the test's stack.
DEFAULT_PORTS = {50051: "gateway", 50052: "scheduler", 50053: "batcher"}
# Commands that are not run, each with the reason.
NOT_RUN = {
    "make up": "starts the stack on the default ports and runs until Ctrl-C; this test starts the same "
    "stack (`asyncinfer up`, which `make up` runs) on free ports instead",
    "make test": "the whole suite, of which this test is a part",
    "LD_LIBRARY_PATH=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var(\"LIBDIR\"))') "
    ".venv/bin/python bench/batcher_servers.py pytriton 8001 affine 8 20": "starts a Triton server (PyTriton) "
    "and runs until Ctrl-C; tests/test_batcher_triton.py starts the same server the same way, on a free port",
    ".venv/bin/python receiver.py &": "the README's webhook receiver (its ```python block, saved as receiver.py) "
    "on a fixed port, left running in the background; the test's submit goes to a free loopback port instead "
    "(CALLBACK_URL), where nothing answers; tests/test_webhook_verify.py runs that block against a real stack",
}
# The webhook example's URL, the README's receiver's: the test puts a free loopback port in its place
# (its stack allows 127.0.0.1 in webhooks.allowed_networks), as the receiver is not run.
CALLBACK_URL = "http://localhost:8099/hook"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
VARIABLE_LINE = re.compile(r"^(export\s+)?([A-Z_][A-Z0-9_]*=\S+\s+)*[A-Z_][A-Z0-9_]*=\S+\s*(#.*)?$")
ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")
EXITS = re.compile(r"exits (\d+)")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@dataclass
class Command:
    line: str
    number: int  # in README.md
    expected_exit: int = 0


@dataclass
class Block:
    number: int  # the line of its opening fence
    variables: list[str] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)


def shell_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    block: Block | None = None
    in_other = False
    comments: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("```"):
            if block is not None or in_other:
                if block is not None:
                    blocks.append(block)
                block, in_other = None, False
            elif line[3:].strip() in SHELLS:
                block, comments = Block(number), []
            else:
                in_other = True
            continue
        if block is None or not line:
            continue
        if line.startswith("#"):
            comments.append(line)
        elif VARIABLE_LINE.match(line) and not block.commands:
            block.variables.append(line)
        else:
            said = [int(m) for c in [*comments, line] for m in EXITS.findall(c)]
            block.commands.append(Command(line, number, said[-1] if said else 0))
            comments = []
    return blocks


def python_blocks(text: str) -> dict[str, str]:
    """The README's first ```python block under each heading (its line), fences of any kind skipped."""
    found: dict[str, str] = {}
    heading, fence, block = "", "", list[str]()
    for raw in text.splitlines():
        line = raw.strip()
        if fence:
            if line == "```":
                if fence == "python":
                    found.setdefault(heading, "\n".join(block) + "\n")
                fence, block = "", []
            elif fence == "python":
                block.append(raw)
        elif line.startswith("```"):
            fence = line[3:].strip() or "text"
        elif raw.startswith("#"):
            heading = line
    return found


def test_the_readme_has_its_shell_blocks_and_every_command_is_run_or_named() -> None:
    blocks = shell_blocks(README.read_text())
    lines = [c.line for b in blocks for c in b.commands]
    assert len(blocks) >= 6
    for skipped in NOT_RUN:
        assert any(line.split("#")[0].strip() == skipped for line in lines), f"NOT_RUN names {skipped!r}: gone"
    for block in blocks:
        for command in block.commands:
            # An address written into a command would meet whatever listens there, not this stack.
            assert not ADDRESS.search(command.line), f"README.md:{command.number}: name the address in a variable"
            uses = set(re.findall(r"\$([A-Z_][A-Z0-9_]*)", command.line))
            defined = {name for v in block.variables for name in re.findall(r"([A-Z_][A-Z0-9_]*)=", v)}
            assert uses <= defined, f"README.md:{command.number}: {uses - defined} not defined in its block"


def write_config(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    ports = {name: free_port() for name in ("nats", "gateway", "scheduler", "batcher")}
    path = tmp_path / "asyncinfer.toml"
    path.write_text(
        f"""
[embedded_nats]
port = {ports["nats"]}
monitor_port = 0
store_dir = "{tmp_path / "data" / "nats"}"

[gateway]
port = {ports["gateway"]}
metrics_port = 0

[scheduler]
port = {ports["scheduler"]}
metrics_port = 0

[batcher]
port = {ports["batcher"]}
metrics_port = 0

[console]
port = 0

[webhooks]
allowed_networks = ["127.0.0.1/32"]
"""
    )
    return path, ports


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    config_path, ports = write_config(tmp_path)
    running = start_up(config_path, {**ports, "metrics": 0}, tmp_path)
    try:
        yield running
        assert stop(running) == 0
    finally:
        close(running)


def test_every_readme_command_runs_against_a_live_stack(up: UpProcess, tmp_path: Path) -> None:
    assert "flaky" in up.banner  # the sample models, as a file without models gets them
    assert "webhook secret (default)" in up.banner  # generated: the webhook example needs one
    workdir = tmp_path / "readme"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(sys.prefix)  # `.venv/bin/grpcurl`, `.venv/bin/asyncinfer`
    addresses = {"gateway": up.gateway, "scheduler": up.scheduler, "batcher": up.batcher}
    callback_url = f"http://127.0.0.1:{free_port()}/hook"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    ran: list[str] = []
    dead_letters: list[str] = []  # what ListDeadLetters answered
    for block in shell_blocks(README.read_text()):
        variables = [ADDRESS.sub(lambda m: addresses[DEFAULT_PORTS[int(m.group(1))]], line) for line in block.variables]
        job_id: str | None = None
        sequence: str | None = None
        for command in block.commands:
            line = command.line
            if line.split("#")[0].strip() in NOT_RUN:
                continue
            if "JOB_ID" in line:
                assert job_id is not None, f"README.md:{command.number}: JOB_ID before any submit in its block"
                line = line.replace("JOB_ID", job_id)
            if "SEQ" in line and "OpsService" in line:
                assert sequence is not None, f"README.md:{command.number}: SEQ before a ListDeadLetters"
                line = line.replace("SEQ", sequence)
            line = line.replace(CALLBACK_URL, callback_url)
            script = "\n".join(["set -u", *variables, line])
            done = subprocess.run(
                ["bash", "-c", script], cwd=workdir, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            where = f"README.md:{command.number}: {command.line}\nstdout: {done.stdout}\nstderr: {done.stderr}"
            assert done.returncode == command.expected_exit, where
            assert "Traceback" not in done.stderr, where
            if "grpcurl" in line and done.returncode == 0:
                assert not re.fullmatch(r"\{\s*\}", done.stdout.strip()), f"an empty answer: {where}"
            if "SubmitJob" in line or "asyncinfer submit" in line:
                found = UUID.search(done.stdout)
                job_id = found.group(0) if found else job_id
            if "ListDeadLetters" in line:
                found = re.search(r'"sequence":\s*"?(\d+)', done.stdout)
                sequence = found.group(1) if found else None
                dead_letters.append(done.stdout)
            ran.append(command.line)
    assert len(ran) >= 30
    sdk = python_blocks(README.read_text())["### The Python SDK"]
    assert sdk.count("127.0.0.1:50051") == 2, "the example's addresses are the default gateway's"
    (workdir / "sdk_example.py").write_text(sdk.replace("127.0.0.1:50051", up.gateway))
    done = subprocess.run(
        [sys.executable, "sdk_example.py"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"the SDK example:\nstdout: {done.stdout}\nstderr: {done.stderr}"
    # Its watch prints each state it sees up to SUCCEEDED; then the 100 bulk jobs, waited and got.
    assert done.stdout.splitlines()[-1] == "100 100", done.stdout
    assert "SUCCEEDED" in done.stdout.splitlines()[:-1], done.stdout
    console = re.search(r"web console\s+(http://\S+)", up.banner)
    assert console is not None, up.banner
    with urllib.request.urlopen(console.group(1), timeout=30) as page:  # its redirect followed
        assert (page.status, page.url.endswith("/queues")) == (200, True)
        assert "<title>Queues · asyncinfer</title>" in page.read().decode()
    assert any("OpsService/Undrain" in line for line in ran)
    # The README's own flaky job was the dead letter its recipes listed, showed and replayed.
    assert any('"flaky"' in answer and "MODEL_ERROR" in answer for answer in dead_letters), dead_letters
