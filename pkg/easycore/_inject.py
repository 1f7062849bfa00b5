"""Decoration-time checks of which names a user function wants injected.

A work function takes the item first and may declare any of ``device``, ``cfg``, ``state`` and
``worker`` as further parameters; ``init``/``end`` declare only injectable names. We read the
signature once, when the decorator runs, and keep the tuple of names to pass, so the hot path
in the worker is a plain ``fn(item, **kwargs)`` with a dict built once per worker.
Also whether a function is ``async def`` (:func:`is_async_fn`): where it runs, and what
decoration refuses.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["call_with", "injected", "injected_names", "is_async_fn"]

PRODUCER_WORK = frozenset({"device", "cfg", "state", "worker"})
PRODUCER_INIT = frozenset({"device", "cfg", "worker"})
PRODUCER_END = frozenset({"device", "cfg", "worker", "state"})
CONSUMER = frozenset({"cfg"})  # a consumer's function, init and end


def injected_names(
    fn: Callable[..., Any], *, role: str, positional: int, allowed: frozenset[str]
) -> tuple[str, ...]:
    """Return the injectable names ``fn`` declares, checking its signature.

    Args:
        fn: the user's callable.
        role: what ``fn`` is, for messages (``"work function"``, ``"init"``...).
        positional: how many leading positional arguments the executor passes (the item: 1,
            the consumer's accumulator and item: 2, ``init``: 0).
        allowed: names the executor can inject for this role.

    Returns:
        The declared injectable names, in signature order.

    Raises:
        TypeError: ``fn`` is not callable, takes ``*args``/``**kwargs``, has too few
            positional parameters, or requires a name that cannot be injected (one with a
            default is left to its default).

    >>> injected_names(lambda x, *, device: x, role="work", positional=1,
    ...                allowed=frozenset({"device"}))
    ('device',)
    """
    if not callable(fn):
        msg = f"{role} must be callable, got {fn!r}"
        raise TypeError(msg)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        # Builtins and C types (``list``, ``torch.cat``) may have no signature; they are
        # called with their leading positional arguments only (toolz ``_check_sigspec``).
        return ()
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    leading = 0
    names: list[str] = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            stars = "*" if p.kind is p.VAR_POSITIONAL else "**"
            how = "as keyword parameters" if stars == "*" else "one by one"
            msg = (
                f"{role} {name!r} takes {stars}{p.name}: declare the injected names "
                f"({', '.join(sorted(allowed))}) {how} instead"
            )
            raise TypeError(msg)
        if leading < positional and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            leading += 1
            continue
        # Left to its default: an option of the function's own (``sorted(key=None)``), or a
        # positional-only parameter, which cannot be named (``list(iterable=(), /)``).
        if p.default is not p.empty and (p.kind is p.POSITIONAL_ONLY or p.name not in allowed):
            continue
        if p.name not in allowed:
            msg = (
                f"{role} {name!r} has parameter {p.name!r}, which easycore cannot fill in: "
                f"the injectable names here are {', '.join(sorted(allowed)) or 'nothing'}"
            )
            raise TypeError(msg)
        if p.kind is p.POSITIONAL_ONLY:
            msg = (
                f"{role} {name!r}: parameter {p.name!r} is positional-only; "
                "injected names are passed by keyword"
            )
            raise TypeError(msg)
        names.append(p.name)
    if leading < positional:
        what = {1: "the item", 2: "the accumulator and the item"}.get(positional, "")
        msg = f"{role} {name!r} must take {what} as its first positional parameter(s)"
        raise TypeError(msg)
    return tuple(names)


def is_async_fn(fn: Any, kind: Callable[[Any], bool] = inspect.iscoroutinefunction) -> bool:
    """``fn`` is an ``async def`` function (``kind=inspect.isasyncgenfunction``: an async
    generator), also behind decorators, a partial, or a callable object whose ``__call__``
    is one."""
    if kind(fn):
        return True
    with contextlib.suppress(ValueError):  # (a wrapper cycle)
        if kind(inspect.unwrap(fn)):
            return True
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return False
    return kind(inspect.getattr_static(type(fn), "__call__", None))


def injected(names: tuple[str, ...], context: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for a function that declared ``names``, taken from ``context``.

    >>> injected(("cfg",), {"cfg": 1, "device": "cpu"})
    {'cfg': 1}
    """
    return {n: context[n] for n in names}


def call_with(
    fn: Callable[..., Any], names: tuple[str, ...], context: Mapping[str, Any], *args: Any
) -> Any:
    """Call ``fn(*args)`` with the names it declared taken from ``context``."""
    return fn(*args, **injected(names, context))
