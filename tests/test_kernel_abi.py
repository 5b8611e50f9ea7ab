"""The kernels' C interface is written once (brisk/kernels/brisk_abi.h, included by every source)
and bound once (brisk/kernels/abi.py): the two agree, name by name and argument by argument."""

import ctypes
import re

from brisk.kernels import abi
from brisk.kernels.build import HEADERS, SOURCES

HEADER = next(h for h in HEADERS if h.name == "brisk_abi.h")
C_TYPES = {"float*": ctypes.c_void_p, "void*": ctypes.c_void_p, "uint8_t*": ctypes.c_void_p,
           "uint16_t*": ctypes.c_void_p, "int8_t*": ctypes.c_void_p, "int32_t*": ctypes.c_void_p,
           "int64_t*": ctypes.c_void_p, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


def declarations() -> dict[str, tuple[str, list[str]]]:
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    body = text[text.index('extern "C" {'):]
    found = {}
    for result, name, params in re.findall(r"(\w+)\s+(brisk_\w+)\(([^)]*)\);", body):
        types = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            words = param.replace("const ", "").replace("*", " * ").split()[:-1]  # drop the name
            types.append("".join(words))
        found[name] = (result, types)
    return found


def _ctype(c_type: str):
    if c_type.startswith("Brisk") and c_type.endswith("*"):
        return getattr(abi, c_type[len("Brisk"):-1])
    return C_TYPES[c_type]


def test_the_binding_declares_every_function_of_the_header_with_its_types():
    declared = declarations()
    assert set(declared) == set(abi.SIGNATURES)
    for name, (result, params) in declared.items():
        args, restype = abi.SIGNATURES[name]
        assert len(args) == len(params), name
        for c_type, py in zip(params, args):
            want = _ctype(c_type)
            assert py == want or (hasattr(py, "_type_") and py._type_ is want), (name, c_type, py)
        assert restype == (None if result == "void" else C_TYPES[result]), name


def test_every_source_includes_the_header_and_declares_no_other_files_functions():
    for source in SOURCES:
        text = source.read_text()
        assert '#include "brisk_abi.h"' in text, source.name
        # a function is defined in one file; a bare declaration (ending in ");") would be a second copy
        assert not re.search(r"^\s*(void|int)\s+brisk_\w+\([^{]*\);", text, re.M), source.name


def test_the_struct_layouts_match_the_header():
    text = HEADER.read_text()
    for struct in (abi.QuantWeight, abi.Layer, abi.Dims, abi.Scratch):
        body = text[text.index(f"struct Brisk{struct.__name__} {{"):]
        body = re.sub(r"//[^\n]*", "", body[:body.index("};")])
        names = re.findall(r"\*?(\w+)\s*[,;]", body.split("{", 1)[1])
        assert [f[0] for f in struct._fields_] == names, struct.__name__
