"""argparse value types that check a flag's range as it is parsed, so a bad value is one line
that names the flag (`argument --max-num-seqs: must be >= 1, got 0`), before anything loads."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import Callable


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        _check(value, minimum, maximum)
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None
           ) -> Callable[[str], float]:
    """A float; `above`: strictly greater than it (a timeout of 0 is no timeout)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, got {text}")
        _check(value, minimum, maximum)
        return value

    parse.__name__ = "number"
    return parse


def _check(value, minimum, maximum) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise argparse.ArgumentTypeError(f"must be in {minimum}-{maximum}, got {value}")
    if minimum is not None and value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")


port = integer(1, 65535)
positive = integer(1)
non_negative = integer(0)

_DEVICE = re.compile(r"(auto|cpu|cuda|cuda:\d+)")


def device(text: str) -> str:
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device brisk runs on; use auto, cpu, cuda or cuda:N")
    return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one `brisk: error:` line: no usage block before it (a
    bad choice already lists the valid ones), and an unknown flag names the closest real one of the
    subcommand given (`--max-model` -> `--max-model-len`; abbreviations are never accepted)."""

    def error(self, message: str, prog: str | None = None):
        self.exit(2, f"brisk: error: {message} (`{prog or self.prog} --help` lists the flags)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            hints = []
            command = _command(self, parsed)
            for extra in extras:
                if extra.startswith("-"):
                    flag = extra.split("=", 1)[0]
                    options = sorted(o for o in command._option_string_actions if o.startswith("--"))  # noqa: SLF001
                    close = [o for o in options if o.startswith(flag) and o != flag] or \
                        difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
                    if close:
                        hints.append(f"did you mean {close[0]}?")
            self.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; {' '.join(hints)}" if hints else ""),
                       command.prog)
        return parsed


def _command(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's parser that was chosen."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _command(chosen, parsed)
    return parser
