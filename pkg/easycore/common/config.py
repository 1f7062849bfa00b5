"""easycore 0.4's ``CfgNode``: the same config tree, mutable until ``freeze()``.

Replacement: :class:`easycore.CfgNode`, which is frozen by default; build a mutable one with
``CfgNode(d, frozen=False)`` or change a frozen one inside ``with cfg.unfrozen():``.

Everything but the default, ``dict()`` and ``str()`` is inherited: ``open``, ``load``,
``dump``, ``save``, ``merge``, ``copy``, ``freeze`` and ``is_frozen`` are
:class:`easycore.CfgNode`'s; ``dict()`` and ``str()`` (a plain dict's text) are 0.4.2's, and so
is :class:`HierarchicalCfgNode` (YAML files that extend another through ``__BASE__``).
Loading stays safe (0.4 could build Python objects from YAML tags; this refuses them), and an
unquoted ``(224, 224)`` still loads as a tuple. Nodes built inside the tree (nested dicts,
loaded YAML, copies) are of this class too, so they are mutable as well.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import easycore

__all__ = ["CfgNode", "HierarchicalCfgNode"]


class CfgNode(easycore.CfgNode):
    """:class:`easycore.CfgNode` with 0.4's default: mutable until :meth:`freeze`.

    Args:
        init_dict: a possibly nested mapping; nested dicts become ``CfgNode`` s.
        copy: deep-copy the values of ``init_dict`` (``False`` shares them).
        frozen: whether the new tree refuses changes (0.4 had no such argument).

    >>> cfg = CfgNode()
    >>> cfg.SOLVER = CfgNode()
    >>> cfg.SOLVER.LEARNING_RATE = 0.001
    >>> cfg.freeze()
    >>> cfg.is_frozen(), isinstance(cfg, easycore.CfgNode)
    (True, True)
    """

    __slots__ = ()

    def __init__(
        self, init_dict: Mapping[str, Any] | None = None, copy: bool = True, frozen: bool = False
    ) -> None:
        super().__init__(init_dict, copy=copy, frozen=frozen)

    def dict(self) -> dict[str, Any]:
        """The tree as plain nested dicts (0.4.2's ``dict()``).

        Returns:
            A new ``dict``, nested nodes as ``dict`` s too.

        >>> CfgNode({"A": 1, "B": {"C": 3}}).dict()
        {'A': 1, 'B': {'C': 3}}
        """
        return {k: v.dict() if isinstance(v, CfgNode) else v for k, v in self.items()}

    def __str__(self) -> str:
        """A plain dict's text, as 0.4.2 printed a config (``easycore.CfgNode`` prints YAML)."""
        return str(self.dict())


class HierarchicalCfgNode:
    """easycore 0.4.2's YAML files that extend another one through a ``__BASE__`` key.

    ``__BASE__: ./base.yaml`` in a file loads ``base.yaml`` first (a path relative to the file,
    else as written) and overrides it with the file's own keys, recursively; a base may have a
    base of its own.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "b.yaml"), "w") as f:
    ...     _ = f.write("A: from b\\nB: from b\\n")
    >>> with open(os.path.join(folder, "a.yaml"), "w") as f:
    ...     _ = f.write("__BASE__: b.yaml\\nA: from a\\n")
    >>> HierarchicalCfgNode.open(os.path.join(folder, "a.yaml")).dict()
    {'A': 'from a', 'B': 'from b'}
    """

    __BASE__ = "__BASE__"

    @classmethod
    def open(cls, file: str | os.PathLike[str], encoding: str = "utf-8") -> CfgNode:
        """Load ``file`` over its chain of bases.

        Args:
            file: the YAML file to load.
            encoding: the encoding of it and its bases.

        Returns:
            A mutable node: the last base, overridden by each file down to ``file``, without
            ``__BASE__`` keys.

        Raises:
            FileNotFoundError: a ``__BASE__`` names no file.
            FileExistsError: the bases loop back to a file already loaded.
        """
        path = os.path.abspath(os.fspath(file))
        seen = [path]
        chain = [CfgNode.open(path, encoding=encoding)]
        while cls.__BASE__ in chain[-1]:
            base = str(chain[-1][cls.__BASE__])
            beside = os.path.join(os.path.dirname(path), base)
            found = next((p for p in (beside, base) if os.path.exists(p)), None)
            if found is None:
                msg = f"{cls.__BASE__}: {base} in {path}: no such file"
                raise FileNotFoundError(msg)
            path = os.path.abspath(found)
            if path in seen:
                msg = f"{path} is its own base (through {' -> '.join(seen)})"
                raise FileExistsError(msg)
            seen.append(path)
            chain.append(CfgNode.open(path, encoding=encoding))
        merged = chain.pop()
        for cfg in reversed(chain):  # each file over its base (its __BASE__ key dropped below)
            merged.merge(cfg)
        merged.pop(cls.__BASE__, None)
        return merged

    @classmethod
    def save(
        cls,
        cfg: Mapping[str, Any],
        save_path: str | os.PathLike[str],
        base_cfg_path: str | os.PathLike[str] | None = None,
        base_path_relative: bool = True,
        encoding: str = "utf-8",
    ) -> None:
        """Save ``cfg``; with ``base_cfg_path``, only what differs from that base, plus a
        ``__BASE__`` key naming it (relative to ``save_path`` unless ``base_path_relative``
        is False).

        Args:
            cfg: the config to save.
            save_path: the YAML file to write.
            base_cfg_path: a config file ``cfg`` extends, or None to save all of ``cfg``.
            base_path_relative: write ``__BASE__`` relative to ``save_path``'s folder
                (else absolute).
            encoding: the encoding of the files.

        Raises:
            FileNotFoundError: ``base_cfg_path`` names no file.
        """
        out = CfgNode(cfg)
        if base_cfg_path is not None:
            out = _without(out, cls.open(base_cfg_path, encoding))  # (FileNotFoundError if none)
            base_path = os.path.abspath(base_cfg_path)
            if base_path_relative:
                where = os.path.dirname(os.path.abspath(save_path))
                base_path = os.path.relpath(base_path, start=where)
            out[cls.__BASE__] = base_path
        out.save(save_path, encoding=encoding)


def _without(cfg: CfgNode, base: Mapping[str, Any]) -> CfgNode:
    """``cfg`` less the keys whose values equal ``base``'s, recursively."""
    out = CfgNode()
    for key, value in cfg.items():
        if key in base and value == base[key]:
            continue
        if isinstance(value, CfgNode) and isinstance(base.get(key), Mapping):
            value = _without(value, base[key])
        out[key] = value
    return out
