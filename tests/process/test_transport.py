"""Tensors and arrays crossing processes: values, dtypes, shapes, sizes, lifetimes."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from easycore import producer

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def big(dtype: torch.dtype, n: int = 40_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(n, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.fixture(scope="module")
def echo_runner():
    with producer(lambda x: x).open(devices=2) as runner:
        yield runner


class TestTensors:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_round_trip_dtypes(self, echo_runner, dtype):
        """Big tensors of every dtype go in and come back equal (both directions)."""
        data = [big(dtype), big(dtype, 50_000).reshape(100, 500)]
        out = echo_runner.map(data)
        for a, b in zip(data, out, strict=True):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(a, b)

    def test_non_contiguous(self, echo_runner):
        """Non-contiguous tensors arrive with the same values (as contiguous tensors)."""
        base = torch.arange(400_000, dtype=torch.float32).reshape(400, 1000)
        data = [base.t(), base[:, ::3], base[::2, 5:]]
        for a, b in zip(data, echo_runner.map(data), strict=True):
            assert torch.equal(a, b)
            assert b.is_contiguous()

    def test_small_and_zero_size(self, echo_runner):
        """Small and empty tensors (below the shared-memory threshold) work too."""
        data = [torch.zeros(0), torch.ones(3, 0, 2), torch.tensor(5.0), torch.arange(10)]
        for a, b in zip(data, echo_runner.map(data), strict=True):
            assert torch.equal(a, b) and a.shape == b.shape

    def test_large_item(self):
        """A 64 MiB tensor crosses both ways."""
        x = torch.arange(16 << 20, dtype=torch.float32)
        (y,) = producer(lambda t: t + 1).map([x], devices=1)
        assert torch.equal(y, x + 1)

    def test_results_outlive_runner(self):
        """Results are ordinary tensors the caller may keep after the runner closes."""
        make = producer(lambda i: torch.full((100_000,), float(i)))
        with make.open(devices=2) as runner:
            out = runner.map(range(20))
        gc.collect()
        for i, t in enumerate(out):
            assert float(t.sum()) == i * 100_000
            t.add_(1)  # writable, owned

    def test_special_tensors_fall_back(self, echo_runner):
        """requires_grad tensors and Parameters keep their kind through the plain path."""
        p = torch.nn.Parameter(torch.ones(100_000))
        g = torch.ones(100_000, requires_grad=True)
        a, b = echo_runner.map([p, g])
        assert isinstance(a, torch.nn.Parameter) and torch.equal(a, p)
        assert b.requires_grad and torch.equal(b, g)

    def test_many_reuse_segments(self, echo_runner):
        """Hundreds of big tensors reuse segments: values stay right, fds do not grow."""

        def count() -> int:
            gc.collect()
            return len(os.listdir("/proc/self/fd"))

        data = [torch.full((300_000,), float(i)) for i in range(50)]
        echo_runner.map(data)
        before = count()
        for _ in range(3):
            out = echo_runner.map(data)
            assert all(float(t[7]) == i for i, t in enumerate(out))
        assert count() <= before

    def test_one_message_with_more_new_segments_than_one_descriptor_batch(self):
        """A result holding 150 big tensors: 150 new segments in one message (descriptors
        travel in groups of at most 64), every value right."""
        make = producer(lambda i: [torch.full((40_000,), float(i * 1000 + k)) for k in range(150)])
        out = make.map(range(3), devices=1)
        for i, tensors in enumerate(out):
            assert [float(t[5]) for t in tensors] == [float(i * 1000 + k) for k in range(150)]

    def test_kept_results_hold_no_descriptors(self):
        """Results kept by the caller share memory with no file descriptor each."""

        def count() -> int:
            gc.collect()
            return len(os.listdir("/proc/self/fd"))

        make = producer(lambda i: torch.full((20_000,), float(i)))
        with make.open(devices=2) as runner:
            before = count()
            kept = runner.map(range(300))
            assert count() < before + 20
            second = runner.map(range(300))
        assert all(float(t[0]) == i for i, t in enumerate(kept))
        assert all(float(t[-1]) == i for i, t in enumerate(second))
        del kept, second


class TestArrays:
    @pytest.mark.parametrize("dtype", ["<f4", "<f8", "<i8", "|u1", "|b1", "<c16", ">i4"])
    def test_round_trip(self, echo_runner, dtype):
        """Big numpy arrays of many dtypes (byte order included) come back equal."""
        rng = np.random.default_rng(0)
        a = (rng.random(100_000) * 100).astype(np.dtype(dtype))
        b2 = a.reshape(250, 400)[:, ::2]  # non-contiguous
        out = echo_runner.map([a, b2])
        for x, y in zip([a, b2], out, strict=True):
            assert y.dtype == x.dtype and y.shape == x.shape
            np.testing.assert_array_equal(x, y)
            assert y.flags.writeable

    def test_object_and_structured_fall_back(self, echo_runner):
        """Object and structured arrays travel by plain pickling."""
        obj = np.array([{"a": 1}] * 20_000, dtype=object)
        rec = np.zeros(20_000, dtype=[("x", "<f8"), ("y", "<i4")])
        a, b = echo_runner.map([obj, rec])
        assert a[5] == {"a": 1}
        np.testing.assert_array_equal(b, rec)
