"""brisk's environment switches (`BRISK_*`), declared in one table and read one way: an unset
switch takes its default, a bad value is one BriskError line naming the variable, the value and
the choices. Operators use them to compare paths or rule one out; none changes a result silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from brisk.errors import BriskError


@dataclass(frozen=True)
class Switch:
    name: str
    choices: tuple[str, ...]  # empty: an integer in [low, high]
    default: str
    doc: str
    low: int = 0
    high: int = 0


SWITCHES = {s.name: s for s in (
    Switch("BRISK_KERNELS", ("auto", "torch"), "auto", "torch: never load the compiled kernels"),
    Switch("BRISK_MATMUL", ("auto", "onednn", "torch"), "auto", "float matmuls: oneDNN packed weights or F.linear"),
    Switch("BRISK_ATTENTION", ("auto", "torch"), "auto", "torch: gather + SDPA instead of the paged kernel"),
    Switch("BRISK_DECODE_STACK", ("auto", "off"), "auto", "off: every decode step layer by layer in Python"),
    Switch("BRISK_KV_HUGEPAGES", ("on", "off"), "on", "off: the KV pool on 4 KB pages"),
    Switch("BRISK_ENGINE_NICENESS", (), "5", "the engine thread's nice value, 0 (off) to 19", 0, 19),
)}


def choice(name: str) -> str:
    """The switch's value, checked against its choices."""
    switch = SWITCHES[name]
    raw = os.environ.get(name)
    value = switch.default if raw is None or raw == "" else raw
    if value not in switch.choices:
        raise BriskError(f"{name}={value!r}: expected one of {', '.join(switch.choices)} "
                         f"(unset means {switch.default}; {switch.doc})")
    return value


def integer(name: str) -> int:
    switch = SWITCHES[name]
    raw = os.environ.get(name)
    text = switch.default if raw is None or raw == "" else raw
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not switch.low <= value <= switch.high:
        raise BriskError(f"{name}={text!r}: expected an integer from {switch.low} to {switch.high} "
                         f"(unset means {switch.default}; {switch.doc})")
    return value


def check_all() -> None:
    """Every switch that is set, checked (at start, so a typo fails before anything loads)."""
    for name, switch in SWITCHES.items():
        if name in os.environ:
            (choice if switch.choices else integer)(name)
