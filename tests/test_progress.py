"""brisk.progress: a rich bar on a terminal, plain lines otherwise."""

import io

from brisk.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_without_a_terminal():
    out = io.StringIO()
    with Progress("converting", 4, every_s=0.0, stream=out) as p:
        for _ in range(4):
            p.advance()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("converting: 1/4 (25%)") and lines[-1].startswith("converting: 4/4 (100%)")
    assert "\x1b[" not in out.getvalue()  # no terminal control codes in a log


def test_a_bar_on_a_terminal():
    out = _Tty()
    with Progress("converting", 4, stream=out) as p:
        for _ in range(4):
            p.advance()
    assert "converting: 4/4" not in out.getvalue()  # the bar, not the plain lines
    assert p.done == 4
