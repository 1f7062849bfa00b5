"""WebDataset shards are tar files as ``tarfile`` writes them (no processes here)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from easycore import producer, write


@producer
def sample(x):
    return {"txt": f"caption {x}", "cls": x, "bin": bytes([x]) * (700 + x)}


def test_a_shard_is_what_tarfile_writes(tmp_path):
    """Byte for byte: USTAR members (mode 0644, padded to blocks), then the end-of-archive
    blocks and the record padding once per file."""
    sink = write.webdataset(str(tmp_path), samples_per_file=2)
    written = (sample >> sink).map(range(3), devices="inline")
    assert len(written.files) == 2
    for k, f in enumerate(sorted(written.files)):
        expected = io.BytesIO()
        with tarfile.open(fileobj=expected, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for x in range(2 * k, min(2 * k + 2, 3)):
                for field, data in (
                    ("txt", f"caption {x}".encode()),
                    ("cls", str(x).encode()),
                    ("bin", bytes([x]) * (700 + x)),
                ):
                    info = tarfile.TarInfo(f"{x}.{field}")
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
        assert Path(f).read_bytes() == expected.getvalue()
