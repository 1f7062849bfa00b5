"""The one adapter from easycore 0.4's runner classes to the functional executor.

Replacement: ``@producer``/``@consumer`` composed with ``>>``, run by ``Pipeline.map`` or
``Pipeline.open``. Re-exported by :mod:`easycore.common.parallel` and
:mod:`easycore.torch.parallel`.

A 0.4 runner class overrides six static methods; :func:`runner_pipeline` turns them into one
producer stage and one consumer stage::

    0.4 static method               functional executor
    ------------------------------  ---------------------------------------------------------
    producer_init(device, cfg)      producer init: cfg = the worker's own mutable copy of the
                                    run's cfg (a 0.4 CfgNode); returned as the stage's state
    producer_work(device, cfg, d)   producer work: called with that same copy (state)
    producer_end(device, cfg)       producer end, at close(): again with that copy
    consumer_init(cfg)              consumer init, once per call: a fresh mutable copy of cfg,
                                    returned as the accumulator
    consumer_work(cfg, data)        the fold: called with the copy, which stays the accumulator
                                    (0.4 ignored what consumer_work returned, and so do we)
    consumer_end(cfg)               consumer end: its value is what runner(data_iter) returns

    Runner(devices, cfg, ...)       easycore.Runner(pipeline, devices, cfg=cfg): workers start
                                    and run producer_init at once, as 0.4's did
    runner(data_iter)               Runner.map(data_iter, ordered=...): OrderedRunner -> True,
                                    UnorderedRunner (and BaseRunner) -> False
    close() / activate()            Runner.close() / a new Runner (cfg copied afresh, as 0.4's
                                    activate() started new processes with new copies)
    is_activate                     Runner.is_active
    queue_scale                     kept for signature compatibility only: the executor's own
                                    bounded window limits the items in flight

Errors are the executor's: a raising ``producer_work`` (which hangs 0.4 forever) raises
:class:`~easycore.WorkerError` here, and the runner is then closed (``activate()`` restarts it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from easycore._exec.runner import Runner
from easycore._pipeline import Pipeline, consumer, producer
from easycore.common.config import CfgNode

__all__ = ["BaseRunner", "OrderedRunner", "UnorderedRunner", "runner_pipeline"]


def runner_pipeline(cls: type[BaseRunner]) -> Pipeline:
    """The ``producer >> consumer`` pipeline equivalent to a 0.4 runner class.

    Only the six static methods travel to the workers (pickled like any work function), never
    the class or a runner instance.

    Args:
        cls: a subclass of :class:`BaseRunner`.

    Returns:
        A :class:`~easycore.Pipeline` of one producer (with ``init``/``end``) and one consumer.

    >>> class Double(OrderedRunner):
    ...     @staticmethod
    ...     def producer_work(device, cfg, data):
    ...         return 2 * data
    ...     @staticmethod
    ...     def consumer_init(cfg):
    ...         cfg.out = []
    ...     @staticmethod
    ...     def consumer_work(cfg, data):
    ...         cfg.out.append(data)
    ...     @staticmethod
    ...     def consumer_end(cfg):
    ...         return cfg.out
    >>> runner_pipeline(Double).map([1, 2, 3], devices="inline")
    [2, 4, 6]
    """
    p_init, p_work, p_end = cls.producer_init, cls.producer_work, cls.producer_end
    c_init, c_work, c_end = cls.consumer_init, cls.consumer_work, cls.consumer_end

    def init(device: str, cfg: Mapping[str, Any]) -> CfgNode:
        return _own(cfg, p_init, device)  # the worker's copy: 0.4 state lives in it

    def work(data: Any, *, device: str, state: CfgNode) -> Any:
        return p_work(device, state, data)

    def end(device: str, state: CfgNode) -> None:
        p_end(device, state)

    def start(cfg: Mapping[str, Any]) -> CfgNode:
        return _own(cfg, c_init)  # fresh for every call, as in 0.4

    def fold(own: CfgNode, data: Any) -> CfgNode:
        c_work(own, data)
        return own

    # The stage's name is what WorkerError messages show: name it after the user's class.
    work.__name__ = f"{cls.__name__}.producer"
    fold.__name__ = f"{cls.__name__}.consumer"
    return producer(init=init, end=end)(work) >> consumer(init=start, end=c_end)(fold)


def _own(cfg: Mapping[str, Any], call: Callable[..., Any], *args: Any) -> CfgNode:
    """A mutable copy of ``cfg``, once ``call(*args, copy)`` has run."""
    own = CfgNode(cfg)
    call(*args, own)
    return own


class BaseRunner:
    """easycore 0.4's runner: override the six static methods, then call the instance.

    Workers start at construction (``producer_init`` runs once in each) and stay up until
    :meth:`close`. Each worker and each call's consumer get their own mutable copy of ``cfg``
    (an ``easycore.common.config.CfgNode``) to keep state in; the caller's ``cfg`` is never
    changed. ``BaseRunner`` delivers results as they finish, like :class:`UnorderedRunner`.

    Args:
        devices: an int (that many CPU workers) or a list of devices such as
            ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``; also anything ``easycore.Runner``
            takes (``"cuda"``, ``"auto"``, ``"inline"``).
        cfg: a mapping or ``CfgNode`` of user data; ``None`` (the default) means empty.
        queue_scale: accepted for 0.4 compatibility; the executor bounds the items in flight
            itself (a few chunks per worker), so it has no further effect.

    Raises:
        ValueError: an impossible device, before any process starts.
        WorkerError: ``producer_init`` raised in a worker.

    >>> class Square(UnorderedRunner):
    ...     @staticmethod
    ...     def producer_work(device, cfg, data):
    ...         return data * data
    ...     @staticmethod
    ...     def consumer_init(cfg):
    ...         cfg.sum = 0
    ...     @staticmethod
    ...     def consumer_work(cfg, data):
    ...         cfg.sum += data
    ...     @staticmethod
    ...     def consumer_end(cfg):
    ...         return cfg.sum
    >>> runner = Square(devices="inline")
    >>> runner(range(4))
    14
    >>> runner.close()
    """

    _ordered: ClassVar[bool] = False

    def __init__(
        self, devices: Any, cfg: Mapping[str, Any] | None = None, queue_scale: float = 3.0
    ) -> None:
        self.devices = devices
        self.cfg: Mapping[str, Any] = CfgNode() if cfg is None else cfg
        self.queue_scale = queue_scale
        self._runner: Runner | None = None
        self._finalizer: weakref.finalize[[], BaseRunner] | None = None
        self.activate()

    # -- the six methods a 0.4 runner overrides (defaults as 0.4 documents them) ----------
    @staticmethod
    def producer_init(device: str, cfg: CfgNode) -> None:
        """Runs once in each worker; keep what ``producer_work`` needs in ``cfg``.

        Args:
            device: the worker's device, such as ``"cpu"`` or ``"cuda:1"``.
            cfg: the worker's own mutable copy of the runner's ``cfg``.
        """

    @staticmethod
    def producer_work(device: str, cfg: CfgNode, data: Any) -> Any:
        """Process one item in a worker; the return value goes to the consumer.

        Args:
            device: the worker's device.
            cfg: the worker's own ``cfg``, as ``producer_init`` left it.
            data: one item of the call's input.

        Returns:
            The result handed to ``consumer_work`` (the default returns ``data``).
        """
        return data

    @staticmethod
    def producer_end(device: str, cfg: CfgNode) -> None:
        """Runs once in each worker at :meth:`close`.

        Args:
            device: the worker's device.
            cfg: the worker's own ``cfg``.
        """

    @staticmethod
    def consumer_init(cfg: CfgNode) -> None:
        """Runs at the start of every call, in the calling process.

        Args:
            cfg: this call's own mutable copy of the runner's ``cfg``.
        """

    @staticmethod
    def consumer_work(cfg: CfgNode, data: Any) -> None:
        """Receives each producer result, in the calling process.

        Args:
            cfg: this call's ``cfg``.
            data: one result of ``producer_work``.
        """

    @staticmethod
    def consumer_end(cfg: CfgNode) -> Any:
        """Runs at the end of every call; its value is the call's result.

        Args:
            cfg: this call's ``cfg``.

        Returns:
            The call's result (the default returns None).
        """
        return None

    # -- running ---------------------------------------------------------------------------
    @property
    def is_activate(self) -> bool:
        """Whether the workers are up (0.4's spelling of ``Runner.is_active``)."""
        return self._runner is not None and self._runner.is_active

    def __call__(self, data_iter: Iterable[Any]) -> Any:
        """Run every item of ``data_iter`` through the workers and the consumer.

        Args:
            data_iter: the items, any iterable.

        Returns:
            What ``consumer_end`` returned.

        Raises:
            RuntimeError: the runner is closed; call :meth:`activate`.
            WorkerError: one of the six methods raised (the runner is closed afterwards).
            WorkerDied: a worker process died.
        """
        assert self._runner is not None  # (__init__ sets it or raises)
        return self._runner.map(data_iter, ordered=self._ordered)

    def activate(self) -> None:
        """Start the workers again after :meth:`close` (or an error); no-op when active.

        Each worker gets a new copy of ``self.cfg`` and runs ``producer_init`` again.
        """
        if self.is_activate:
            return
        self.close()  # (a runner an error closed: its finaliser dropped)
        self._runner = runner = Runner(runner_pipeline(type(self)), self.devices, cfg=self.cfg)
        # 0.4 closed its runner on garbage collection and at interpreter exit; so do we.
        self._finalizer = weakref.finalize(self, runner.close)

    def close(self) -> None:
        """Run ``producer_end`` in every worker and stop them; idempotent.

        Raises:
            WorkerError: a ``producer_end`` raised (the workers are stopped all the same).
        """
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._runner is not None:
            self._runner.close()

    def __repr__(self) -> str:
        state = "active" if self.is_activate else "closed"
        return f"<{type(self).__name__} on {self.devices!r} ({state})>"


class UnorderedRunner(BaseRunner):
    """A 0.4 runner whose consumer receives results as they finish (``ordered=False``)."""


class OrderedRunner(BaseRunner):
    """A 0.4 runner whose consumer receives results in input order (``ordered=True``)."""

    _ordered: ClassVar[bool] = True
