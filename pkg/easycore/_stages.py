"""Prepared stages: the one copy of "run the user's producers on an item".

A hop's fused producers, prepared where they run (a worker process, the calling process for
``devices="inline"``, or any other engine): :meth:`PreparedStages.start` runs every ``init``
with its injected names, :meth:`~PreparedStages.run` runs the stages over one unit (seeded
from its index when the run has a seed), :meth:`~PreparedStages.run_chunk` over a chunk
with retries, and :meth:`~PreparedStages.finish` runs every ``end``. Failures come back as
:class:`StageFailure` values naming the stage; the caller turns them into errors.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from easycore._errors import WorkerError, user_error
from easycore._inject import call_with, injected
from easycore._protocol import (
    AT_INDEX,
    AT_STARTED,
    CACHED,
    RUNNING,
    ErrorReport,
    Task,
    is_cached,
)
from easycore._seeding import derive_seed, drop_hooks, seed_loaded, seed_on_import
from easycore._sinks import ShardWriter, Sink, is_sink

__all__ = ["PreparedStages", "StageDef", "StageFailure"]


class StageDef(Protocol):
    """What running needs of a producer stage (``easycore.Stage`` is one)."""

    @property
    def fn(self) -> Callable[..., Any]: ...
    @property
    def name(self) -> str: ...
    @property
    def has_init(self) -> bool: ...
    @property
    def init(self) -> Any: ...
    @property
    def end(self) -> Callable[..., Any] | None: ...
    @property
    def fn_names(self) -> tuple[str, ...]: ...
    @property
    def init_names(self) -> tuple[str, ...]: ...
    @property
    def end_names(self) -> tuple[str, ...]: ...


class StageFailure(NamedTuple):
    """User code raised: ``stage`` names it (``"load (init)"`` for an init), ``error`` is it."""

    stage: str
    error: BaseException

    def report(self) -> ErrorReport:
        """The failure as it crosses to the caller from another process."""
        return ErrorReport.of(self.stage, self.error)

    def to_error(self, what: str, index: int | None, device: str | None = "cpu") -> WorkerError:
        """The ``WorkerError`` for a failure in this process: an inline stage (``device``
        ``"cpu"``, worker 0) or the consumer (``device=None``). Raise it ``from`` ``error``."""
        exc = self.error
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return user_error(
            self.stage,
            type(exc).__name__,
            str(exc),
            tb,
            what=what,
            device=device,
            worker=0 if device is not None else None,
            index=index,
            remote=False,
        )


class _Prepared:
    __slots__ = ("end", "end_names", "fn", "kwargs", "name", "state")

    def __init__(self, stage: StageDef, state: Any, context: dict[str, Any]) -> None:
        self.fn = stage.fn
        self.name = stage.name
        self.state = state
        self.kwargs = injected(stage.fn_names, {**context, "state": state})
        self.end = stage.end
        self.end_names = stage.end_names


class PreparedStages:
    """A hop's fused producers in the place they run: ``init`` done, names injected.

    Args:
        stages: the hop's producers, in order.
        device, cfg, worker: what ``device``, ``cfg`` and ``worker`` inject.
        hop: the hop's number in the chain (seeds differ per hop).
        in_caller: the stages run in the calling process (``devices="inline"``): torch or
            numpy first imported by an item's own work is seeded for that item (a worker
            installs such hooks once, at start-up), and only ``Exception``s count as the
            stage's failure (Ctrl-C and ``SystemExit`` propagate, as in any other code).
    """

    def __init__(
        self,
        stages: Sequence[StageDef],
        *,
        device: str,
        cfg: Any,
        worker: int,
        hop: int = 0,
        in_caller: bool = False,
    ) -> None:
        defs = tuple(stages)
        # a sink ends the last pool's stages: it writes what they make (see easycore._sinks)
        self.sink: Sink | None = defs[-1] if defs and is_sink(defs[-1]) else None  # type: ignore[assignment]
        self.defs = defs[:-1] if self.sink is not None else defs
        self.writer: ShardWriter | None = None
        self.context: dict[str, Any] = {"device": device, "cfg": cfg, "worker": worker}
        self.hop = hop
        self.in_caller = in_caller
        self.catch: type[BaseException] = Exception if in_caller else BaseException
        self.prepared: list[_Prepared] = []

    # -- init / end ----------------------------------------------------------------------
    def start(self) -> StageFailure | None:
        """Run every ``init`` in order; stop at the first that raises and return it."""
        self.prepared = []
        for stage in self.defs:
            state = None
            if stage.has_init:
                try:
                    state = call_with(stage.init, stage.init_names, self.context)
                except self.catch as exc:
                    return StageFailure(f"{stage.name} (init)", exc)
            self.prepared.append(_Prepared(stage, state, self.context))
        if self.sink is not None:
            try:
                self.writer = ShardWriter(self.sink, self.context["worker"])
            except self.catch as exc:
                return StageFailure(f"{self.sink.name} (init)", exc)
        return None

    def finish(self) -> StageFailure | None:
        """Run ``end`` of every started stage, all of them; return the first failure."""
        first: StageFailure | None = None
        for st in self.prepared:
            if st.end is None:
                continue
            try:
                call_with(st.end, st.end_names, {**self.context, "state": st.state})
            except self.catch as exc:
                if first is None:
                    first = StageFailure(f"{st.name} (end)", exc)
        self.prepared = []
        return first

    # -- items ---------------------------------------------------------------------------
    def write(
        self, base: int, values: list[Any], inputs: Any, skip: Any = (), keys: Any = None
    ) -> list[tuple[int, StageFailure]]:
        """With a sink: write the results ``values`` of units ``base + k`` (not those at
        positions ``skip``: failed) to files; each written value becomes a small
        ``Wrote``. Returns the units whose results could not be written, as failures of the
        sink (their value is None). Without a sink: nothing."""
        if self.writer is None or self.sink is None:
            return []
        name = self.sink.name
        try:
            bad = self.writer.write(base, values, inputs, skip, keys)
        except self.catch as exc:  # the file itself failed: every unit of the chunk does
            skipped = set(skip)
            bad = [(k, exc) for k in range(len(values)) if k not in skipped]
            for k, _ in bad:
                values[k] = None
        return [(k, StageFailure(name, exc)) for k, exc in bad]

    def run(
        self, item: Any, index: int, seed: int | None, numbering: tuple[int, int] = (0, 1)
    ) -> tuple[Any, StageFailure | None]:
        """Run the stages over unit ``index`` once: ``(value, None)`` or ``(None, failure)``."""
        hooks: list[Any] = []
        if seed is not None:
            seed_loaded(derive_seed(seed, numbering[0] + index * numbering[1], self.hop))
            if self.in_caller:
                hooks = seed_on_import()
        value = item
        try:
            for st in self.prepared:
                try:
                    value = st.fn(value, **st.kwargs)
                except self.catch as exc:
                    return None, StageFailure(st.name, exc)
        finally:
            if hooks:
                drop_hooks(hooks)
        return value, None

    def run_retrying(
        self,
        item: Any,
        index: int,
        seed: int | None,
        allowed: int,
        numbering: tuple[int, int] = (0, 1),
    ) -> tuple[Any, StageFailure | None]:
        """:meth:`run`, again while it fails and ``allowed`` retries remain."""
        attempt = 0
        while True:
            value, failed = self.run(item, index, seed, numbering)
            if failed is None or attempt >= allowed:
                return value, failed
            attempt += 1

    def retries_left(self, task: Task, index: int) -> int:
        """Retries unit ``index`` of ``task`` may still use (deaths have charged some)."""
        if not task.spent:
            return task.retries
        return task.retries - task.spent.get((self.hop, index), 0)

    def run_chunk(
        self,
        units: Any,
        base: int,
        task: Task,
        cur: Any,
        at: int,
        stop: Any,
        since: float | None = None,
    ) -> tuple[list[Any], list[tuple[int, ErrorReport]]]:
        """Run the stages over a chunk's units (unit ``k`` is unit ``base + k`` of the hop).

        Failed units are retried here while ``task`` allows; what still fails is reported as
        ``(position, ErrorReport)`` with ``None`` in its place. The index of the unit in
        hand, and with a timeout its start time, go into the shared slot ``cur[at:]``;
        ``since`` (when the chunk's unpickling began) is the first unit's start time.
        """
        values: list[Any] = []
        errors: list[tuple[int, ErrorReport]] = []
        only = self.prepared[0] if len(self.prepared) == 1 else None
        if only is not None and not (
            only.kwargs or task.seed is not None or task.timed or task.retries or task.resumed
        ):
            # the hot path: one stage, nothing injected, no per-item seed, clock or retry
            fast = only.fn
            append = values.append
            where = float(base)
            here = at + AT_INDEX  # (per item, only the store: this loop is W1's whole cost)
            for item in units:
                cur[here] = where
                where += 1.0
                try:
                    append(fast(item))
                except BaseException as exc:
                    errors.append((len(values), ErrorReport.of(only.name, exc)))
                    append(None)
            return self._written(base, values, errors, units, cur, at, task)
        index = base
        for item in units:
            if task.resumed and is_cached(item):
                values.append(CACHED)
                index += 1
                continue
            allowed = self.retries_left(task, index)
            attempt = 0
            while True:
                value, failed = self.run_marked(item, index, task, cur, at, since)
                since = None  # a retry, and the next unit, start their own clock
                if failed is None or attempt >= allowed:
                    break
                attempt += 1
            if failed is not None:
                errors.append((len(values), failed.report()))
            values.append(value)
            index += 1
            if stop.is_set():
                break
        return self._written(base, values, errors, units, cur, at, task)

    def _written(
        self,
        base: int,
        values: list[Any],
        errors: list[tuple[int, ErrorReport]],
        units: Any,
        cur: Any,
        at: int,
        task: Task,
    ) -> tuple[list[Any], list[tuple[int, ErrorReport]]]:
        """A chunk's values, written by the sink when there is one (:meth:`write`)."""
        if self.writer is None:
            return values, errors
        cur[at + AT_STARTED] = RUNNING  # writing is no unit's time: `timeout` does not apply
        bad = self.write(base, values, units, [k for k, _ in errors], task.keys)
        if bad:
            errors = sorted([*errors, *((k, f.report()) for k, f in bad)], key=lambda e: e[0])
        return values, errors

    def run_marked(
        self, item: Any, index: int, task: Task, cur: Any, at: int, since: float | None = None
    ) -> tuple[Any, StageFailure | None]:
        """:meth:`run` once, with the unit's index (and start time, when timed: ``since``, or
        now) in the slot."""
        cur[at + AT_INDEX] = float(index)
        if task.timed:
            cur[at + AT_STARTED] = time.monotonic() if since is None else since
        return self.run(item, index, task.seed, task.numbering)
