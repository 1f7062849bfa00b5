"""The public surface: names, __all__, and that `import easycore` stays light."""

from __future__ import annotations

import subprocess
import sys

import easycore


class TestExports:
    def test_all_sorted_and_present(self):
        """__all__ is sorted and every name in it exists."""
        assert list(easycore.__all__) == sorted(easycore.__all__)
        for name in easycore.__all__:
            assert hasattr(easycore, name), name

    def test_contract_names(self):
        """The names the contract (docs/contract.md) fixes are exported."""
        for name in [
            "producer",
            "consumer",
            "compose",
            "CfgNode",
            "Registry",
            "EasycoreError",
            "WorkerError",
            "WorkerDied",
            "ItemTimeout",
            "FrozenError",
            "__version__",
            "derive_seed",
            "permutation",
            "save_checkpoint",
            "load_checkpoint",
        ]:
            assert name in easycore.__all__

    def test_import_does_not_load_torch(self):
        """`import easycore` does not import torch (CfgNode/Registry users never pay for it)."""
        code = "import sys, easycore; print('torch' in sys.modules)"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "False"

    def test_import_and_a_local_run_do_not_load_ray(self):
        """Ray is optional: `import easycore` and the local engine never import it."""
        code = (
            "import sys, easycore\n"
            "sq = easycore.producer(lambda x: x * x)\n"
            "assert sq.map([1, 2], devices='inline') == [1, 4]\n"
            "print('ray' in sys.modules)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "False"

    def test_version(self):
        """A version string is exposed."""
        assert easycore.__version__.count(".") >= 1
