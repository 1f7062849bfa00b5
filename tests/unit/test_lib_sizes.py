"""Sizes in bytes (``bytes_per_file=``, ``max_worker_memory=``): one parser, whose errors name
the option (no processes here)."""

from __future__ import annotations

import pytest

from easycore import producer, write


@producer
def double(x):
    return 2 * x


class TestSizes:
    def test_units(self, tmp_path):
        """Decimal and binary units, with or without a space, and plain ints."""
        sizes = {"1MiB": 1 << 20, "1.5 kB": 1500, "2GB": 2 * 10**9, "7": 7, 64: 64}
        for text, size in sizes.items():
            assert write.jsonl(str(tmp_path), bytes_per_file=text).bytes_per_file == size

    @pytest.mark.parametrize("value", ["lots", "0.5B", "0", -1, True, 1.5, None])
    def test_not_a_size_names_bytes_per_file(self, tmp_path, value):
        """A size that is not a positive number of bytes (also one that rounds to none)."""
        with pytest.raises(ValueError, match=r"bytes_per_file must be a size: a positive"):
            write.jsonl(str(tmp_path), bytes_per_file=value)

    def test_not_a_size_names_max_worker_memory(self):
        """The same parser reads max_worker_memory, and its error names that option."""
        assert double.map([1, 2], devices="inline", max_worker_memory="1GiB") == [2, 4]
        with pytest.raises(ValueError, match=r"max_worker_memory must be a size: a positive"):
            double.map([1], devices="inline", max_worker_memory="lots")
