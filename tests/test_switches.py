"""brisk's BRISK_* environment switches: one table, one way to read them, one error line."""

import subprocess
import sys

import pytest

from brisk import switches
from brisk.errors import BriskError


def test_unset_switches_take_their_defaults(monkeypatch):
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert switches.choice("BRISK_ATTENTION") == "auto" and switches.choice("BRISK_KV_HUGEPAGES") == "on"
    assert switches.integer("BRISK_ENGINE_NICENESS") == 5
    switches.check_all()


@pytest.mark.parametrize("name, value, needle", [
    ("BRISK_ATTENTION", "sdpa", "BRISK_ATTENTION='sdpa': expected one of auto, torch (unset means auto"),
    ("BRISK_MATMUL", "mkl", "BRISK_MATMUL='mkl': expected one of auto, onednn, torch"),
    ("BRISK_DECODE_STACK", "0", "BRISK_DECODE_STACK='0': expected one of auto, off"),
    ("BRISK_KV_HUGEPAGES", "yes", "BRISK_KV_HUGEPAGES='yes': expected one of on, off"),
    ("BRISK_KERNELS", "none", "BRISK_KERNELS='none': expected one of auto, torch"),
    ("BRISK_ENGINE_NICENESS", "20", "BRISK_ENGINE_NICENESS='20': expected an integer from 0 to 19"),
    ("BRISK_ENGINE_NICENESS", "low", "BRISK_ENGINE_NICENESS='low': expected an integer from 0 to 19"),
])
def test_a_bad_value_is_one_error_naming_the_switch(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(BriskError, match=None) as e:
        switches.check_all()
    assert needle in str(e.value)


def test_every_switch_is_read_through_the_table():
    """No module reads a BRISK_* switch from os.environ behind the table's back."""
    from pathlib import Path

    root = Path(switches.__file__).parent
    stray = [f"{p.relative_to(root)}: {name}" for p in root.rglob("*.py") if p.name != "switches.py"
             for name in switches.SWITCHES if f'"{name}"' in p.read_text(encoding="utf-8")
             and f'switches.choice("{name}")' not in p.read_text(encoding="utf-8")
             and f'switches.integer("{name}")' not in p.read_text(encoding="utf-8")]
    assert stray == []


def test_serve_refuses_a_mistyped_switch_before_loading():
    env = {"BRISK_ATTENTION": "sdpa", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "brisk", "serve", "--port", "1"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("brisk: error: BRISK_ATTENTION='sdpa'"), proc.stderr
