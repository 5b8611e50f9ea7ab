"""Writing the files a command was asked for (--json, --csv, --html, --plot): parent folders are
created, and a path that cannot be written is one clear error, not a traceback after the work."""

from __future__ import annotations

from pathlib import Path

from brisk.errors import BriskError


def output_path(path: str | Path, flag: str) -> Path:
    """`path` with its parent folder created; raises BriskError naming `flag` if impossible."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BriskError(f"{flag} {path}: cannot create its folder ({e.strerror or e})") from None
    if path.is_dir():
        raise BriskError(f"{flag} {path} is a folder; give a file name")
    return path


def output_dir(path: str | Path, flag: str) -> Path:
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BriskError(f"{flag} {path}: cannot create the folder ({e.strerror or e})") from None
    return path


def write_output(path: str | Path, text: str, flag: str) -> Path:
    path = output_path(path, flag)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BriskError(f"{flag} {path}: cannot write ({e.strerror or e})") from None
    return path
