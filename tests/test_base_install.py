"""`pip install asyncinfer` (the base, no extra) in a fresh virtual environment: the SDK imports and
the client CLI runs with no torch, nats-py or uvloop installed; a server command names the extra.

Offline, as CI may be: the project's wheel is built here (`pip wheel --no-deps --no-build-isolation`,
with this environment's setuptools), and the wheels of the base's dependencies are made from the
distributions installed in this environment (each one's files as its RECORD lists them): only the
closure of what the built wheel's metadata requires goes into the wheelhouse. The fresh venv then
gets a real `pip install --no-index --find-links WHEELHOUSE asyncinfer`, pip resolving the base's
dependencies itself: a dependency the base lacks fails the install or the imports, and a server
dependency the base declares shows up as importable."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SERVER_ONLY = ("torch", "nats", "uvloop", "prometheus_client", "stamina", "tritonclient", "aiohttp", "opentelemetry")

pytestmark = pytest.mark.timeout(600)


def run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def build_project_wheel(source: Path, wheelhouse: Path) -> Path:
    """The project's wheel, built from a copy of what it packages (the build writes beside it)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("asyncinfer", "services"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheelhouse, ".", cwd=source
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheelhouse.glob("asyncinfer-*.whl")
    return wheel


def base_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(name).decode()
    return [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]


def closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions the requirements need, without extras, transitively."""
    found: dict[str, metadata.Distribution] = {}
    pending = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while pending:
        requirement = pending.pop()
        key = canonicalize_name(requirement.name)
        if key in found:
            continue
        dist = metadata.distribution(requirement.name)
        assert dist.version in requirement.specifier, f"{requirement} is not what this environment has: {dist.version}"
        found[key] = dist
        for line in dist.requires or ():
            needed = Requirement(line)
            if needed.marker is None or needed.marker.evaluate({"extra": ""}):
                pending.append(needed)
    return list(found.values())


def repack(dist: metadata.Distribution, wheelhouse: Path) -> None:
    """The installed distribution as a wheel again: the files its RECORD lists under site-packages
    (scripts and data outside it are left out: pip makes console scripts from entry_points)."""
    site = Path(str(dist.locate_file("")))
    info_dir = next(p for p in dist.files or () if p.parts[0].endswith(".dist-info")).parts[0]
    wheel_meta = (site / info_dir / "WHEEL").read_text()
    tag = re.search(r"^Tag: (\S+)$", wheel_meta, re.MULTILINE)
    assert tag is not None, f"{info_dir} has no WHEEL tag"
    target = wheelhouse / f"{info_dir.removesuffix('.dist-info')}-{tag.group(1)}.whl"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        for file in dist.files or ():
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue
            path = site / file
            if path.is_file():
                archive.write(path, file.as_posix())


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("base-install")
    source, wheelhouse = work / "source", work / "wheelhouse"
    source.mkdir()
    wheelhouse.mkdir()
    wheel = build_project_wheel(source, wheelhouse)
    for dist in closure(base_requirements(wheel)):
        repack(dist, wheelhouse)
    venv = work / "venv"
    # Without pip of its own (ensurepip's install of pip into it was a quarter of this fixture): this
    # environment's pip installs into it, run with its interpreter (pip's --python).
    made = run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--find-links", wheelhouse,
        "asyncinfer", cwd=work,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv


def clean_env() -> dict[str, str]:
    """No PYTHONPATH (the repository must not be what gets imported)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_sdk_imports_without_the_servers_dependencies(base_venv: Path, tmp_path: Path) -> None:
    script = (
        "import importlib.util, asyncinfer\n"
        "from asyncinfer.client import AsyncClient, Client, verify_webhook\n"
        # A receiver verifies a delivery with the base alone (signed here as the scheduler signs).
        "import base64, hashlib, hmac, time\n"
        "key, at, body = b'k' * 32, int(time.time()), b'{\"type\": \"job.completed\"}'\n"
        "mac = hmac.new(key, f'msg_1.{at}.'.encode() + body, hashlib.sha256).digest()\n"
        "headers = {'webhook-id': 'msg_1', 'webhook-timestamp': str(at),\n"
        "           'webhook-signature': 'v1,' + base64.b64encode(mac).decode()}\n"
        "secret = 'whsec_' + base64.b64encode(key).decode()\n"
        "assert verify_webhook(headers, body, secret) == {'type': 'job.completed'}\n"
        f"present = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not present, present\n"
        "print(asyncinfer.__file__)\n"
    )
    checked = run(base_venv / "bin" / "python", "-c", script, cwd=tmp_path, env=clean_env())
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert str(base_venv) in checked.stdout  # the installed package, not the repository


def test_the_client_cli_runs_and_a_server_command_names_its_extra(base_venv: Path, tmp_path: Path) -> None:
    command = base_venv / "bin" / "asyncinfer"
    helped = run(command, "--help", cwd=tmp_path, env=clean_env())
    assert helped.returncode == 0, helped.stderr
    for name in ("submit", "get", "watch", "bulk", "stats", "up"):
        assert name in helped.stdout
    listed = run(command, "submit", "--help", cwd=tmp_path, env=clean_env())
    assert listed.returncode == 0, listed.stderr
    as_module = run(base_venv / "bin" / "python", "-m", "asyncinfer", "--version", cwd=tmp_path, env=clean_env())
    assert as_module.returncode == 0, as_module.stderr
    completes = run(command, "completion", "bash", cwd=tmp_path, env=clean_env())
    assert completes.returncode == 0, completes.stderr
    assert "submit" in completes.stdout
    up = run(command, "up", cwd=tmp_path, env=clean_env())
    assert up.returncode == 2
    assert "pip install 'asyncinfer[all]'" in up.stderr
    assert "nats" in up.stderr
    assert "Traceback" not in up.stderr


def test_an_editable_install_is_a_plain_path_entry_without_setuptools_warning(tmp_path: Path) -> None:
    """`pip install -e .` (`make up`'s first run) printed setuptools' boxed "Editable installation ...
    be careful with folders in your working directory" warning: with no `package-dir`, its flat-layout
    check fails and it installs a meta path finder, warning about it. `package-dir = {"" = "."}` makes
    it the simple layout, installed as one .pth line naming the checkout."""
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("asyncinfer", "services"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    script = f"from setuptools import build_meta; print(build_meta.build_editable({str(out)!r}))"
    built = run(sys.executable, "-c", script, cwd=source)
    assert built.returncode == 0, built.stdout + built.stderr
    said = built.stdout + built.stderr
    assert "Editable installation" not in said, said
    assert "careful with folders" not in said, said
    (wheel,) = out.glob("asyncinfer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (pth,) = [n for n in archive.namelist() if n.endswith(".pth")]
        assert archive.read(pth).decode().strip() == str(source)
