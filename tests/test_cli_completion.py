"""`asyncinfer completion bash|zsh|fish`: each script names every subcommand of the parser (and the
subcommands of dlq and queue), and, where the shell is installed, completes them when sourced."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from asyncinfer import completion
from services.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def script(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "completion", shell],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@pytest.mark.unit
@pytest.mark.parametrize("shell", completion.SHELLS)
def test_the_script_names_every_subcommand(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    text = capsys.readouterr().out
    commands = subcommands(build_parser())
    assert {"submit", "get", "watch", "bulk", "dlq", "queue", "stats", "up", "completion"} <= set(commands)
    for name, parser in commands.items():
        assert name in text, f"{shell}: {name}"
        for nested in subcommands(parser) if name in ("dlq", "queue") else ():
            assert nested in text, f"{shell}: {name} {nested}"
    option = "-l priority" if shell == "fish" else "--priority"
    assert option in text


@pytest.mark.unit
def test_an_unknown_shell_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["completion", "tcsh-or-so"])
    assert exited.value.code == 2
    assert "bash" in capsys.readouterr().err


def test_bash_completes_subcommands_once_sourced(tmp_path: Path) -> None:
    path = tmp_path / "asyncinfer.bash"
    path.write_text(script("bash"))
    probe = f"""set -u
source {path}
complete -p asyncinfer
COMP_WORDS=(asyncinfer dl); COMP_CWORD=1; _shtab_asyncinfer; echo "top: ${{COMPREPLY[*]}}"
COMP_WORDS=(asyncinfer dlq ""); COMP_CWORD=2; _shtab_asyncinfer; echo "dlq: ${{COMPREPLY[*]}}"
COMP_WORDS=(asyncinfer submit --prio); COMP_CWORD=2; _shtab_asyncinfer; echo "option: ${{COMPREPLY[*]}}"
"""
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "top: dlq" in lines
    assert "dlq: list show replay purge" in lines
    assert "option: --priority" in lines


def test_zsh_reads_the_script(tmp_path: Path) -> None:
    path = tmp_path / "_asyncinfer"
    path.write_text(script("zsh"))
    done = subprocess.run(["zsh", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


def test_fish_completes_subcommands_options_and_choices(tmp_path: Path) -> None:
    path = tmp_path / "asyncinfer.fish"
    path.write_text(script("fish"))

    def complete(line: str) -> list[str]:
        done = subprocess.run(
            ["fish", "--no-config", "-c", f"source {path}; complete -C '{line}'"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert not done.stderr
        return [entry.split("\t")[0] for entry in done.stdout.splitlines()]

    top = complete("asyncinfer ")
    assert set(subcommands(build_parser())) <= set(top)
    assert complete("asyncinfer dlq ") == ["list", "purge", "replay", "show"]
    assert complete("asyncinfer submit demo --prio") == ["--priority"]
    assert complete("asyncinfer submit demo --priority ") == ["HIGH", "LOW", "NORMAL"]
    assert complete("asyncinfer completion ") == ["bash", "fish", "zsh"]
    assert "--state" not in complete("asyncinfer dlq list --")  # list's option, not dlq list's
