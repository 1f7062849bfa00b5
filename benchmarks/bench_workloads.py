"""Work functions, inputs and correctness checks of the easycore benchmarks (W1-W4).

Worker processes of every library import this module to find the work functions by
reference, so it stays light: torch and numpy are imported inside the functions that need
them, never at module level.

Workloads (sizes are the defaults; ``--quick`` shrinks them):

* **W1** ``square(x) = x * x`` over 200,000 ints, summed by the caller (easycore: a consumer).
* **W2** ``busy_5ms(x)`` over 400 items: pure-Python integer arithmetic calibrated by the
  parent to take about 5 ms on this machine; the iteration count reaches every process
  through the ``EASYCORE_BENCH_W2_ITERS`` environment variable so all libraries do exactly
  the same work.
* **W3** ``make_tensor(i)`` returns a 4 MiB float32 ``torch.full((1 << 20,), i)``; 200 items.
* **W3b** the same as numpy arrays (``np.full``).
* **W3 / W3b streamed** (variant ``stream=1``): the same results consumed as they arrive and
  then dropped, as a loop that inspects each output and hands it on does: the
  caller folds each one (:func:`fold_tensor`, :func:`fold_array`: checks it, reads an
  element on each of its pages) instead of keeping it.
* **W4** ``identity(x)`` on one item: the cost of creating, using and shutting down a pool.
* **W5** two unbalanced stages over 3,000 items: ``w5_decode`` (about 0.6 ms of pure Python
  making a 1024-float feature vector) then a "model" (a 1024 x 4096 float32 matrix, 16 MiB,
  loaded once per process) scoring it. Fused, every process runs both per item (a model
  call per item, one model copy per process); with pools, decode runs on 2 workers and the
  model on 1 worker fed batches of 64 (``w5_predict_batch``): the same functions' work, each
  stage at its own granularity, on the same 3 processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

#: Elements per W3/W3b array: 1 << 20 float32 = 4 MiB.
W3_ELEMENTS = 1 << 20
#: Bytes per W3/W3b array.
W3_BYTES = W3_ELEMENTS * 4
#: Environment variable carrying the calibrated W2 iteration count to every process.
W2_ENV = "EASYCORE_BENCH_W2_ITERS"
#: Fallback iteration count (about 5 ms on a ~3 GHz core with CPython 3.11).
W2_DEFAULT_ITERS = 60_000
#: Target duration of one W2 item.
W2_SECONDS = 0.005

_W2_ITERS = int(os.environ.get(W2_ENV, W2_DEFAULT_ITERS))


# ---------------------------------------------------------------------------------------------
# work functions (module level, so every library pickles them by reference)
# ---------------------------------------------------------------------------------------------
def square(x: int) -> int:
    """W1: the smallest useful item of work."""
    return x * x


def w2_iters() -> int:
    """Pure-Python iterations that take ``W2_SECONDS`` here (calibrated by the harness)."""
    return _W2_ITERS


def spin(seed: int, iters: int) -> int:
    """``iters`` iterations of pure-Python arithmetic (holds the GIL)."""
    v = seed
    for _ in range(iters):
        v = (v * 1103515245 + 12345) & 0x7FFFFFFF
    return v


def busy_5ms(x: int) -> int:
    """W2: about 5 ms of pure-Python CPU work (holds the GIL); the result depends on ``x``."""
    return spin(x, _W2_ITERS)


def make_tensor(i: int) -> Any:
    """W3: a new 4 MiB float32 tensor filled with ``i`` (torch's own thread settings)."""
    import torch

    return torch.full((W3_ELEMENTS,), float(i), dtype=torch.float32)


_ONE_THREAD = False


def make_tensor_1thread(i: int) -> Any:
    """W3 for peers: as :func:`make_tensor`, after ``torch.set_num_threads(1)`` in this process.

    Two workers on a small machine oversubscribe the cores with torch's default thread pool;
    a careful user of a peer library limits it like this (easycore does it by itself).
    """
    global _ONE_THREAD
    import torch

    if not _ONE_THREAD:
        torch.set_num_threads(1)
        _ONE_THREAD = True
    return torch.full((W3_ELEMENTS,), float(i), dtype=torch.float32)


def make_array(i: int) -> Any:
    """W3b: a new 4 MiB float32 numpy array filled with ``i``."""
    import numpy as np

    return np.full(W3_ELEMENTS, i, dtype=np.float32)


def identity(x: int) -> int:
    """W4: no work at all."""
    return x


#: W5 sizes: features per item, model outputs, items per model batch.
W5_DIM, W5_OUT, W5_BATCH = 1024, 4096, 64
_W5_MODEL: Any = None


def w5_decode(x: int) -> Any:
    """W5 stage 1: about 0.6 ms of pure Python turning ``x`` into a float32 feature vector."""
    import numpy as np

    v = [((x * 31 + i * 17) % 1000) / 1000.0 for i in range(W5_DIM)]
    for _ in range(6):
        v = [a * 0.5 + 0.25 for a in v]
    return np.asarray(v, dtype=np.float32)


def w5_load() -> Any:
    """W5 model: a fixed 16 MiB weight matrix (the same in every process)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(W5_DIM, W5_OUT, generator=g) / W5_DIM**0.5


def _w5_model() -> Any:
    global _W5_MODEL
    if _W5_MODEL is None:
        _W5_MODEL = w5_load()
    return _W5_MODEL


def w5_predict(v: Any, model: Any = None) -> float:
    """W5 stage 2 per item: the model's score of one feature vector."""
    import torch

    model = _w5_model() if model is None else model
    return float((torch.from_numpy(v) @ model).sum())


def w5_predict_batch(vs: Sequence[Any], model: Any = None) -> list[float]:
    """W5 stage 2 per batch: the same scores for a list of feature vectors, in one call."""
    import numpy as np
    import torch

    model = _w5_model() if model is None else model
    return (torch.from_numpy(np.stack(vs)) @ model).sum(dim=1).tolist()


def w5_fused(x: int) -> float:
    """W5 fused: both stages for one item (the model loaded once per process)."""
    return w5_predict(w5_decode(x))


def w5_fused_1thread(x: int) -> float:
    """W5 fused for peers: after ``torch.set_num_threads(1)`` (3 processes on few cores)."""
    global _ONE_THREAD
    import torch

    if not _ONE_THREAD:
        torch.set_num_threads(1)
        _ONE_THREAD = True
    return w5_fused(x)


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------
def calibrate_w2(target: float = W2_SECONDS, trials: int = 7) -> int:
    """Return the iteration count for which :func:`busy_5ms` takes about ``target`` seconds.

    The core first spins for ~0.2 s (a cold core runs slower and would make the items
    short), then the count is refined at full size until two estimates agree within 2%.
    Uses the fastest of several trials, so background load during calibration does not
    shrink the work; the harness reports the item duration actually reached.
    """
    iters = 20_000
    deadline = time.perf_counter() + 0.2
    while time.perf_counter() < deadline:
        spin(1, iters)
    for _ in range(5):
        best = min(_timed(lambda n=iters: spin(1, n)) for _ in range(trials))
        estimate = max(1_000, round(iters * target / best))
        if abs(estimate - iters) <= 0.02 * iters:
            return estimate
        iters = estimate
    return iters


def w2_item_seconds(iters: int, trials: int = 7) -> float:
    """Fastest measured duration of one W2 item with ``iters`` iterations."""
    return min(_timed(lambda: spin(1, iters)) for _ in range(trials))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# correctness checks (run after the timed section, on what the caller received)
# ---------------------------------------------------------------------------------------------
class WrongResult(AssertionError):
    """A library returned something other than the expected result."""


def _fail(msg: str) -> None:
    raise WrongResult(msg)


def check_w1(result: Any, n: int) -> None:
    """The sum of squares of ``range(n)``."""
    expected = (n - 1) * n * (2 * n - 1) // 6
    if result != expected:
        _fail(f"W1: sum is {result!r}, expected {expected}")


def check_w2(result: Any, n: int) -> None:
    """``n`` results in input order; a few of them recomputed here."""
    if not isinstance(result, list) or len(result) != n:
        _fail(f"W2: expected a list of {n} results, got {type(result).__name__}")
    for i in sorted({0, n // 2, n - 1}):
        if result[i] != busy_5ms(i):
            _fail(f"W2: result {i} is {result[i]!r}, expected {busy_5ms(i)!r}")


def check_w3(result: Any, n: int) -> None:
    """``n`` float32 tensors of 1 << 20 elements, tensor ``i`` filled with ``i``, all intact."""
    import torch

    _check_arrays(result, n, torch.Tensor, torch.float32, lambda a, i: bool((a == i).all()))


def check_w3b(result: Any, n: int) -> None:
    """``n`` float32 numpy arrays of 1 << 20 elements, array ``i`` filled with ``i``."""
    import numpy as np

    _check_arrays(result, n, np.ndarray, np.float32, lambda a, i: bool((a == i).all()))


def _check_arrays(
    result: Any, n: int, kind: type, dtype: Any, all_equal: Callable[[Any, int], bool]
) -> None:
    if not isinstance(result, list) or len(result) != n:
        _fail(f"expected a list of {n} arrays, got {type(result).__name__}")
    for i, a in enumerate(result):
        if not isinstance(a, kind):
            _fail(f"item {i}: expected {kind.__name__}, got {type(a).__name__}")
        if a.dtype != dtype or tuple(a.shape) != (W3_ELEMENTS,):
            _fail(f"item {i}: dtype {a.dtype} shape {tuple(a.shape)}")
        if not all_equal(a, i):
            _fail(f"item {i}: contents differ from {i}")


def fold_tensor(acc: tuple[int, float], t: Any) -> tuple[int, float]:
    """W3 streamed: what the caller does with each tensor before dropping it (see _fold)."""
    import torch

    if not isinstance(t, torch.Tensor):
        _fail(f"streamed result {acc[0]}: a {type(t).__name__}, expected a torch.Tensor")
    lo, hi = torch.aminmax(t[::_PAGE_ELEMENTS])
    return _fold(acc, t, torch.float32, float(lo), float(hi))


def fold_array(acc: tuple[int, float], a: Any) -> tuple[int, float]:
    """W3b streamed: what the caller does with each array before dropping it (see _fold)."""
    import numpy as np

    if not isinstance(a, np.ndarray):
        _fail(f"streamed result {acc[0]}: a {type(a).__name__}, expected a numpy array")
    page = a[::_PAGE_ELEMENTS]
    return _fold(acc, a, np.float32, float(page.min()), float(page.max()))


def _fold(acc: tuple[int, float], a: Any, dtype: Any, lo: float, hi: float) -> tuple[int, float]:
    """Check one streamed result and count it: ``acc`` is (results so far, running total).

    Result ``i`` must be array/tensor ``i`` (so order counts) with the right dtype and shape,
    and one element on each of its 4 KiB pages equal to ``i`` (the minimum and maximum of
    those; exact in float32): every page is mapped and checked, as by a consumer that looks
    at each output, without turning the benchmark into a test of the caller's memory
    bandwidth (a full pass over 800 MB costs ~80 ms here, whatever the transport). Its value
    joins the total.
    """
    count, total = acc
    if a.dtype != dtype or tuple(a.shape) != (W3_ELEMENTS,):
        _fail(f"streamed result {count}: dtype {a.dtype} shape {tuple(a.shape)}")
    if not lo == hi == count:
        _fail(f"streamed result {count}: elements from {lo} to {hi}, expected all {count}")
    return count + 1, total + hi


_PAGE_ELEMENTS = 4096 // 4  # float32 elements per 4 KiB page

#: The caller's fold per streamed workload, and its start value.
FOLDS: dict[str, Callable[[tuple[int, float], Any], tuple[int, float]]] = {
    "W3": fold_tensor,
    "W3b": fold_array,
}
FOLD_INIT = (0, 0.0)


def check_folded(result: Any, n: int) -> None:
    """W3/W3b streamed: ``n`` results folded, in order (each fold checked its result)."""
    expected = (n, float(n * (n - 1) // 2))
    if result != expected:
        _fail(f"streamed: folded {result!r}, expected {expected!r}")


def check_w4(result: Any, n: int) -> None:
    """``[0]`` back (W4 runs one item, 0)."""
    expected = list(range(n))
    if list(result) != expected:
        _fail(f"W4: got {result!r}, expected {expected!r}")


def check_w5(result: Any, n: int) -> None:
    """``n`` scores in input order; a sample recomputed here (float tolerance: batching)."""
    if not isinstance(result, list) or len(result) != n:
        _fail(f"W5: expected a list of {n} scores, got {type(result).__name__}")
    for i in sorted({0, 1, n // 3, n // 2, n - 1}):
        want = w5_fused(i)
        if abs(result[i] - want) > 1e-3 * max(1.0, abs(want)):
            _fail(f"W5: score {i} is {result[i]!r}, expected {want!r}")


#: How many items each workload runs (default, --quick).
SIZES: dict[str, tuple[int, int]] = {
    "W1": (200_000, 20_000),
    "W2": (400, 40),
    "W3": (200, 20),
    "W3b": (200, 20),
    "W4": (1, 1),
    "W5": (3_000, 300),
    "W6": (100, 100),  # batches per epoch (bench_training.CASES has each case's own)
    "W7": (100_000, 100_000),  # items per epoch (bench_training.RESUME_ITEMS)
    "W7 write": (200_000, 20_000),  # results of 256 float32 written (bench_write)
    "W8": (2_000, 400),  # requests (bench_waiting)
}

#: Correctness check per workload: ``check(result, n_items)``.
CHECKS: dict[str, Callable[[Any, int], None]] = {
    "W1": check_w1,
    "W2": check_w2,
    "W3": check_w3,
    "W3b": check_w3b,
    "W4": check_w4,
    "W5": check_w5,
}


def items_for(workload: str, n: int) -> Sequence[int]:
    """Inputs of a workload: ``range(n)`` (lazy ints; every library takes a range)."""
    del workload
    return range(n)
