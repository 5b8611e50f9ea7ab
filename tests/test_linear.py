"""brisk's Linear: the packed-oneDNN path agrees with F.linear for every row count, with and
without bias, and falls back to F.linear where it cannot pack."""

import types

import pytest
import torch
import torch.nn.functional as F

from brisk.errors import BriskError
from brisk.kernels.paths import onednn_available
from brisk.models import linear
from brisk.models.linear import Linear


def make(in_features, out_features, bias, dtype=torch.float32):
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.05)
    return layer


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(rows, bias):
    layer = make(96, 200, bias)
    layer.prepare()
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_onednn_path_is_taken_on_cpu(monkeypatch):
    if not linear.ONEDNN_ENABLED:
        pytest.skip("this torch build has no oneDNN")
    layer = make(64, 64, False)
    layer.prepare()
    assert layer._packed is not None

    def no_fallback(*args, **kwargs):
        raise AssertionError("F.linear was called: the packed path was not taken")

    monkeypatch.setattr(linear, "F", types.SimpleNamespace(linear=no_fallback))
    for rows in (1, 16):
        assert layer(torch.randn(rows, 64)).shape == (rows, 64)


def test_non_contiguous_input_and_other_dtypes():
    layer = make(32, 48, True)
    x = torch.randn(32, 10).t()  # [10, 32], not contiguous
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    half = make(32, 48, False, torch.float16)  # not packable: F.linear
    x16 = torch.randn(5, 32, dtype=torch.float16)
    torch.testing.assert_close(half(x16), F.linear(x16, half.weight), rtol=1e-3, atol=1e-3)
    assert half._packed is None


def test_bad_backend_choice_is_named(monkeypatch):
    monkeypatch.setenv("BRISK_MATMUL", "numpy")
    with pytest.raises(BriskError, match="BRISK_MATMUL=.numpy."):
        onednn_available()


@pytest.mark.skipif(torch.float32 not in linear._PACKABLE or torch.bfloat16 not in linear._PACKABLE,
                    reason="bf16 is packed only on CPUs with native bf16 dot products")
def test_bfloat16_packed_matches_f_linear():
    layer = make(128, 96, True, torch.bfloat16)
    layer.prepare()
    assert layer._packed is not None
    x = torch.randn(33, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    reference = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_mapped_weights_give_their_pages_back_and_stay_readable(tmp_path):
    """The loader releases a packed linear's float original (a view of the mapped file)."""
    from safetensors.torch import save_file

    from brisk.loading.safetensors_io import load_file

    weight = torch.randn(4096, 2048)  # 32 MiB
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))
    tensors, mapped = load_file(tmp_path / "w.safetensors")
    view = tensors["w"]
    assert float(view.sum()) == pytest.approx(float(weight.sum()), rel=1e-4)  # touch every page
    before = _rss_bytes()
    assert mapped.release(view)
    assert before - _rss_bytes() > 0.9 * view.numel() * 4
    assert torch.equal(view, weight)  # read again from the file
    assert not mapped.release(torch.randn(1024))  # not in the map: refused, never zeroed


def test_onednn_sees_only_bucketed_row_counts(monkeypatch):
    """Issue 18 #5: oneDNN builds one kernel per distinct row count (RSS grew with traffic); rows
    are padded to a bounded set of buckets, and the padding never changes the result."""
    from brisk.models import linear as L

    if not L.ONEDNN_ENABLED:
        pytest.skip("no oneDNN in this torch build")
    seen = []
    real = L._onednn_linear

    def recording(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(L, "_onednn_linear", recording)
    torch.manual_seed(0)
    layer = L.Linear(64, 48)
    layer.prepare()
    x = torch.randn(700, 64)
    counts = list(range(1, 100)) + [130, 200, 300, 513, 699]
    for rows in counts:
        out = layer(x[:rows])
        assert out.shape == (rows, 48)
        if rows in (1, 9, 63, 65, 300, 513, 699):
            torch.testing.assert_close(out, torch.nn.functional.linear(x[:rows], layer.weight, layer.bias),
                                       rtol=1e-4, atol=1e-4)
    assert set(seen) == {L.row_bucket(r) for r in counts}
    assert len({L.row_bucket(r) for r in range(1, 513)}) <= 50  # 512 row counts, a bounded number of kernels
    three_d = layer(x[:30].reshape(3, 10, 64))  # [batch, seq, features] keeps its shape
    assert three_d.shape == (3, 10, 48)
    assert all(L.row_bucket(r) >= r and L.row_bucket(r) - r <= max(3, r // 4) for r in range(1, 5000))
