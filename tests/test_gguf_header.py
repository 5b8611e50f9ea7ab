"""brisk.loading.gguf_header reads a GGUF as the `gguf` package's own reader does (the reference):
the same metadata, arrays included, the same tensors and the same bytes for each."""

import numpy as np
import pytest

from brisk.errors import ModelLoadError
from brisk.loading.gguf_header import GGUFFile, read_gguf_metadata
from brisk.models.registry import resolve


@pytest.fixture(scope="module")
def reference():
    import gguf

    return gguf.GGUFReader(str(resolve(None).path))


def test_same_metadata_and_tensors_as_the_gguf_package(reference):
    path = resolve(None).path
    ours = GGUFFile(path)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(expected)
    for key, value in expected.items():
        got = ours.metadata[key]
        if isinstance(value, float):
            assert got == pytest.approx(value), key
        else:
            assert got == value, key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [(t.name, t.type_name, tuple(t.dims)) for t in ours.tensors] == \
        [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert np.array_equal(ours.data(mine), np.asarray(theirs.data).reshape(-1).view(np.uint8)), mine.name


def test_header_only_reading_gives_array_lengths():
    quick = read_gguf_metadata(resolve(None).path)
    assert quick["tokenizer.ggml.tokens"] == range(49152)


def test_not_gguf_and_truncated_files_are_one_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    whole = resolve(None).path.read_bytes()
    bad.write_bytes(whole[:4096])  # the header and part of the vocabulary
    with pytest.raises(ModelLoadError, match="cut short or corrupt .* truncated or damaged"):
        read_gguf_metadata(bad)
    bad.write_bytes(whole[:len(whole) // 2])  # the header whole, the tensors cut
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(bad)
