"""`asyncinfer completion bash|zsh|fish`: a tab-completion script for the command, printed.

Static scripts, generated from the argparse parser itself, so that a TAB does not start Python
(the command takes about a second to import): bash and zsh by shtab, the generator argparse
programs use; fish (which shtab lacks) by `fish_script` below, from the same parser. Either way the
subcommands, their options and the options' choices are the parser's, never a list kept apart.
"""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh", "fish")


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    if shell == "fish":
        return fish_script(parser)
    import shtab  # only here: the rest of the CLI runs without it

    return str(shtab.complete(parser, shell=shell))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """name -> (help, parser) of the parser's subcommands."""
    for action in parser._actions:  # argparse has no public way to walk a parser
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    return {}


def _fish_options(prog: str, condition: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        parts = [f"complete -c {prog} -n {shlex.quote(condition)}"]
        if not action.option_strings:  # a positional: its choices, if it has any
            if action.choices:
                lines.append(f"{parts[0]} -f -a {shlex.quote(' '.join(map(str, action.choices)))}")
            continue
        for option in action.option_strings:
            parts.append(f"-l {option[2:]}" if option.startswith("--") else f"-s {option[1:]}")
        if action.nargs != 0:
            parts.append("-r")
            if action.choices:
                parts.append(f"-f -a {shlex.quote(' '.join(map(str, action.choices)))}")
        if action.help:
            parts.append(f"-d {shlex.quote(_short(action.help))}")
        lines.append(" ".join(parts))
    return lines


def _short(help_text: str) -> str:
    return help_text.split(" (")[0].split("; ")[0].strip()


# The words typed so far, options left out, start with the arguments (-x: are exactly them): the
# subcommand's place, so that `dlq list` is not taken for `list`.
_FISH_WORDS = """function __{prog}_words
    set -l exact 0
    if test "$argv[1]" = -x
        set exact 1
        set -e argv[1]
    end
    set -l words
    for token in (commandline -opc)[2..-1]
        string match -q -- '-*' $token; or set -a words $token
    end
    if test $exact = 1
        test "$words" = "$argv"
        return
    end
    set -l n (count $argv)
    test (count $words) -ge $n; and test "$words[1..$n]" = "$argv"
end
"""


def fish_script(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    words = f"__{prog.replace('-', '_')}_words"
    lines = [
        f"# fish completion for {prog}: `{prog} completion fish | source`,",
        f"# or save it as ~/.config/fish/completions/{prog}.fish",
        _FISH_WORDS.replace("__{prog}_words", words),
    ]
    lines += _fish_options(prog, "true", parser)
    for name, (help_text, sub) in _subcommands(parser).items():
        at_top = f"{words} -x"
        lines.append(f"complete -c {prog} -n {shlex.quote(at_top)} -f -a {name} -d {shlex.quote(_short(help_text))}")
        for child, (child_help, child_parser) in _subcommands(sub).items():
            here = f"{words} -x {name}"
            lines.append(
                f"complete -c {prog} -n {shlex.quote(here)} -f -a {child} -d {shlex.quote(_short(child_help))}"
            )
            lines += _fish_options(prog, f"{words} {name} {child}", child_parser)
        lines += _fish_options(prog, f"{words} {name}", sub)
    return "\n".join(lines) + "\n"
