"""The hook that seeds a library right after its first import (``_seeding._AfterImport``)."""

import sys

from easycore._seeding import _AfterImport


def test_two_hooks_for_one_module_both_fire_and_the_import_succeeds(tmp_path, monkeypatch):
    """A worker may install the hook for a module twice (its start, then a run's seeding):
    the import must still succeed, each hook called once, the loader left as it was."""
    (tmp_path / "hooked_mod_for_test.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks = [
        _AfterImport("hooked_mod_for_test", lambda m, k=k: seen.append((k, m.VALUE)))
        for k in (1, 2)
    ]
    sys.meta_path[:0] = hooks
    try:
        import hooked_mod_for_test  # noqa: F401

        assert sorted(seen) == [(1, 7), (2, 7)]
        loader = sys.modules["hooked_mod_for_test"].__spec__.loader
        assert "exec_module" not in vars(loader)
        assert not any(h in sys.meta_path for h in hooks)
    finally:
        for h in hooks:
            if h in sys.meta_path:
                sys.meta_path.remove(h)
        sys.modules.pop("hooked_mod_for_test", None)
