"""Seeds: one per item from ``(seed, index)``, applied to ``random``, numpy and torch.

Used alike by worker processes, inline runs and every engine, so a seeded run gives the
same results wherever its items run. A worker that has not loaded torch or numpy yet gets
import hooks instead: the module is seeded (and torch given its thread budget) the moment
the work imports it, exactly as if it had been loaded from the start.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import operator
import random
import sys
from collections.abc import Callable
from contextvars import ContextVar
from math import isqrt
from typing import Any

__all__ = [
    "bind_thread",
    "check_epoch",
    "check_int",
    "derive_seed",
    "drop_hooks",
    "epoch_seed",
    "item_seed",
    "permutation",
    "seed_everything",
    "seed_loaded",
    "seed_on_import",
    "setup_torch",
]

_LAST_SEED: int | None = None  # the last value given to seed_everything in this process
# The seed of the item in hand (its own for each asyncio task or thread of a worker).
ITEM_SEED: ContextVar[int | None] = ContextVar("easycore_item_seed", default=None)


def item_seed() -> int | None:
    """The seed of the item being run here: ``derive_seed(seed, index)`` of the run's ``seed=``.

    Call it inside a producer. It is the value the worker seeded ``random``, numpy and
    torch with just before the item started, and it stays the item's own while other items
    of the same worker run concurrently (``.on(n, concurrency=k)``): an async item or a
    thread gets its own value. Use it for randomness that must not depend on how items
    interleave, e.g. ``rng = random.Random(easycore.item_seed())``.

    Returns:
        The item's seed (an int), or None when the run has no ``seed=`` or outside an item.

    >>> item_seed() is None
    True
    """
    return ITEM_SEED.get()


def derive_seed(seed: int, index: int, pool: int = 0, *, epoch: int = 0) -> int:
    """The seed workers use for item ``index`` of a run with ``seed=seed``: a 63-bit int.

    ``seed_everything(derive_seed(seed, i, epoch=e))`` in a loop of one's own gives item ``i``
    the random state a worker gives it in a run with ``seed=seed, epoch=e`` (with
    ``batch_size``, ``i`` counts batches; ``pool`` is the place of an ``.on`` pool in the
    pipeline, 0 for the first). Epoch 0 gives the seeds of a run without ``epoch``; every
    other epoch gives every item another seed, the same on every run.

    Args:
        seed: the run's ``seed``.
        index: the item's (or batch's) index in the input.
        pool: the pool's place in the pipeline (0: the first).
        epoch: the run's ``epoch`` (an int >= 0).

    Returns:
        A non-negative int below ``2**63``, the same in every process.

    Raises:
        TypeError: ``seed``, ``index``, ``pool`` or ``epoch`` is not an int (numpy ints are
            ints; bools are not).
        ValueError: ``pool`` or ``epoch`` is negative.

    >>> derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(0, 2)
    True
    >>> derive_seed(0, 1, epoch=1) != derive_seed(0, 1)
    True
    """
    if type(seed) is not int or type(index) is not int or type(pool) is not int or pool < 0:
        seed, index = check_int("seed", seed), check_int("index", index)
        pool = check_int("pool", pool, 0)
    if type(epoch) is not int or epoch:
        seed = epoch_seed(seed, epoch)
    return _digest(f"{seed}:{index}" if pool == 0 else f"{seed}:{pool}:{index}")


def _digest(key: str) -> int:
    """A 63-bit int from ``key``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed a run with ``seed`` and ``epoch`` hands its workers (``seed`` at epoch 0):
    per-item seeds are derived from it as from a plain seed.

    Raises:
        TypeError: ``epoch`` is not an int.
        ValueError: ``epoch`` is negative.
    """
    epoch = check_epoch(epoch)
    return _digest(f"{seed}@epoch:{epoch}") if epoch else seed


def check_epoch(epoch: Any) -> int:
    """``epoch`` as an int: TypeError unless it is one, ValueError if it is negative."""
    return check_int("epoch", epoch, 0)


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as a plain int (a numpy int too), for the argument ``name``.

    Raises:
        TypeError: ``value`` is not an int, or is a bool (``True`` as a seed or a count is
            a mistake, not a 1).
        ValueError: ``value`` is below ``minimum``.
    """
    number = None
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):  # (numpy's bool has no __index__ either)
            number = operator.index(value)
    if number is None:
        msg = f"{name} must be an int, got {value!r} of type {type(value).__name__}"
        raise TypeError(msg)
    if minimum is not None and number < minimum:
        msg = f"{name} must be an int >= {minimum}, got {number}"
        raise ValueError(msg)
    return number


def permutation(n: int, seed: int, epoch: int = 0) -> list[int]:
    """A seeded permutation of ``range(n)``: the same on every run, another every epoch.

    For shuffling a sized dataset per epoch in a way a resumed run repeats:
    ``runner.imap([dataset[i] for i in permutation(len(dataset), seed, epoch)], ...)``, or
    better an index list the producer loads from.

    It is ``random.Random(derive_seed(seed, -1, epoch=epoch)).shuffle`` of ``range(n)``, as
    it always was, on every platform; with numpy installed a long one is computed in numpy
    batches from the same draws (``10**7`` indices in a second or two instead of ten).

    Args:
        n: how many indices (an int >= 0).
        seed: any int.
        epoch: the epoch (an int >= 0).

    Returns:
        A list holding each of ``0 .. n-1`` once.

    Raises:
        TypeError: ``n``, ``seed`` or ``epoch`` is not an int (numpy ints are ints).
        ValueError: ``n`` or ``epoch`` is negative.

    >>> sorted(permutation(5, seed=0)) == [0, 1, 2, 3, 4]
    True
    >>> permutation(10, 0, epoch=1) == permutation(10, 0, epoch=1) != permutation(10, 0)
    True
    """
    n = check_int("n", n, 0)
    # random.Random(int).shuffle is the same on every platform and Python 3 version
    rng = random.Random(derive_seed(seed, -1, epoch=epoch))
    if 1 << 16 <= n < 1 << 32 and importlib.util.find_spec("numpy") is not None:
        return _shuffled_range(n, rng)  # the same list, several times sooner
    order = list(range(n))
    rng.shuffle(order)
    return order


def _shuffled_range(n: int, rng: random.Random) -> list[int]:
    """What ``rng.shuffle(list(range(n)))`` makes, from the same draws, in numpy batches.

    ``shuffle`` swaps position ``b - 1`` (``b`` from ``n`` down to 2) with ``j``, the first
    draw below ``b``; a draw is one 32-bit word of the Mersenne Twister shifted right to
    ``b.bit_length()`` bits. numpy's MT19937, started in ``rng``'s state, gives the same
    words; they are taken a window at a time, the window short enough that ``b`` keeps its
    bit length and few draws land near ``b`` (see :func:`_swap_window`).
    """
    import numpy as np

    key = rng.getstate()[1]
    twister = np.random.MT19937()
    twister.state = {
        "bit_generator": "MT19937",
        "state": {"key": np.array(key[:624], np.uint32), "pos": key[624]},
    }
    order = np.arange(n, dtype=np.int32 if n < 1 << 31 else np.int64)
    words = np.empty(0, np.uint32)
    b = n
    while b > 1:
        bits = b.bit_length()
        width = min(isqrt(b), b - (1 << (bits - 1)) + 1)
        if words.size < width:
            more = twister.random_raw(max(width, 1 << 16)).astype(np.uint32)
            words = np.concatenate([words, more])
        b = _swap_window(order, (words[:width] >> (32 - bits)).astype(np.intp), b)
        words = words[width:]
    result: list[int] = order.tolist()
    return result


def _swap_window(order: Any, draws: Any, b: int) -> int:
    """Do ``shuffle``'s swaps for ``draws`` (all of one bit length) from bound ``b``; return
    the bound after them.

    When no draw lies in ``[b - len(draws), b)``, each is taken (below ``b``) or refused
    whatever the bound by then, and the positions swapped (``b - 1``, ``b - 2``... with the
    draws taken) are all different unless a draw repeats: then the swaps commute and run as
    one gather and scatter (a repeat shows as a lost write, and is undone). Otherwise the
    window is halved, down to a few draws done one by one.
    """
    width = draws.size
    if not ((draws >= b - width) & (draws < b)).any():
        taken = draws[draws < b]
        mine = order[b - taken.size : b][::-1].copy()
        theirs = order[taken]
        order[taken] = mine
        if (order[taken] == mine).all():
            order[b - taken.size : b] = theirs[::-1]
            return b - taken.size
        order[taken] = theirs  # a draw repeats: undo (both of its writes held one value)
    if width <= 8:
        for j in draws.tolist():
            if j < b:
                b -= 1
                order[b], order[j] = order[j], order[b]
        return b
    b = _swap_window(order, draws[: width // 2], b)
    return _swap_window(order, draws[width // 2 :], b)


def seed_everything(value: int) -> None:
    """Seed ``random``, numpy and torch as the workers do before each item of a seeded run.

    numpy and torch are seeded now when loaded, else the moment they are first imported
    (importing torch only to seed it would cost a second).

    Args:
        value: the seed (for example ``derive_seed(seed, i)``).

    >>> import random
    >>> seed_everything(3); a = random.random()
    >>> seed_everything(3); a == random.random()
    True
    """
    seed_loaded(value)
    if not any(hook in sys.meta_path for hook in _WAITING):  # none left of an earlier call
        _WAITING[:] = seed_on_import()


_WAITING: list[Any] = []  # the import hooks of seed_everything (they read _LAST_SEED)


def seed_loaded(value: int) -> None:
    """Seed ``random``, and numpy and torch (CPU and CUDA) where they are loaded already.

    A worker seeds a unit with this; numpy or torch imported later by the work itself are
    seeded with the same value on import (see :func:`seed_on_import`).
    """
    global _LAST_SEED
    _LAST_SEED = value
    random.seed(value)
    # numpy's generators once numpy.random is imported: numpy 2 imports it on first use
    # (10 ms in a fresh worker, which a worker that never draws should not pay)
    npr = sys.modules.get("numpy.random")
    if npr is not None:
        npr.seed(value % (2**32))
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: while CUDA is not initialised it records a formatted stack
        # for a lazy CUDA call, tens of milliseconds in a fresh worker, on every call.
        torch.default_generator.manual_seed(value)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(value)


def setup_torch(device: str, n_threads: int | None) -> None:
    """Bind the device and give torch its share of threads, now or when the work imports it.

    A worker from the torch forkserver (or on a GPU) has torch loaded already. One from the
    light forkserver (a caller that never imported torch) does not, and pays for the import
    only if its work needs torch: then, right after the import, torch gets the thread budget
    and the worker's current seed, exactly as if it had been loaded from the start.
    """
    if device.startswith("cuda") or "torch" in sys.modules:
        import torch

        _torch_loaded(n_threads, torch)
        bind_thread(device)  # before anything can touch CUDA: the context lands on our device
        return
    seed_on_import(n_threads)


def bind_thread(device: str) -> None:
    """Bind ``device`` in a thread that runs items besides the main one (a worker's event
    loop, its item threads): CUDA's current device is per thread."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(torch.device(device))


def seed_on_import(n_threads: int | None = None) -> list[Any]:
    """Make a later import of torch or numpy seed it (and set torch's threads) at once.

    Returns the import hooks put in place (each removes itself once its module loads), for
    :func:`drop_hooks`.
    """
    wanted = {"torch": functools.partial(_torch_loaded, n_threads), "numpy.random": _numpy_loaded}
    hooks = [_AfterImport(name, then) for name, then in wanted.items() if name not in sys.modules]
    sys.meta_path[:0] = hooks
    return hooks


def drop_hooks(hooks: list[Any]) -> None:
    """Remove import hooks of :func:`seed_on_import` that have not fired."""
    for hook in hooks:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(hook)


def _torch_loaded(n_threads: int | None, torch: Any) -> None:
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    if _LAST_SEED is not None:
        torch.default_generator.manual_seed(_LAST_SEED)


def _numpy_loaded(npr: Any) -> None:
    if _LAST_SEED is not None:
        npr.seed(_LAST_SEED % (2**32))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once, right after the module ``name`` is first imported: the
    finder of that module, whose own loader's ``exec_module`` then calls."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then
        self.looking = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self.looking:
            return None
        self.looking = True  # the search below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.looking = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        load = loader.exec_module

        def exec_module(module: Any) -> None:
            # (the loader's own again: it may load other modules; a second hook for the
            # same module wrapped this one, and took it off already)
            vars(loader).pop("exec_module", None)
            load(module)
            drop_hooks([self])
            self.then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
