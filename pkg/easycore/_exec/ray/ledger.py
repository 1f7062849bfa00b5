"""The driver's record of each Ray actor (a place of the run's scheduler), and what a Ray
run needs of its engine.

The Ray counterpart of ``workers.Worker``. A chunk goes down the whole chain at once (each
hop's actor is handed the hop before's result reference), so it sits in the queue of one
actor of every hop until that hop's small ``Meta`` comes back (the scheduler's pipelined
mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from easycore._exec.core.plan import Chain
from easycore._exec.core.scheduler import Place
from easycore._exec.ray.actor import Placement

__all__ = ["Actor", "ActorPools", "first_line", "ray_module"]


def ray_module() -> Any:
    """The ray module (imported on first use: ``import easycore`` never imports it)."""
    import ray

    return ray


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.split("\n", 1)[0][:300]


@attrs.define(eq=False, kw_only=True)
class Actor(Place):
    """One actor of a hop, as the driver tracks it (what it has: :class:`Place`; a dead
    one is replaced when its pool next needs it, a failing run's never)."""

    device: str
    handle: Any
    where: Placement | None = None
    cut_short: bool = False  # a run was cancelled while it had work: it may be mid-unit
    # Not an actor but a slot of Ray tasks (an init-less pool; see actor.run_task): sends
    # ``run``'s arguments as a task; its chunks run independently of each other (``lone``:
    # it holds one at a time).
    task: Callable[..., Any] | None = None

    def run(self, *args: Any) -> Any:
        """Send a chunk: ``(values ref, meta ref)``."""
        if self.task is not None:
            return self.task(*args)
        return self.handle.run.options(num_returns=2).remote(*args)

    def who(self, chain: Chain) -> str:
        kind = "Ray task" if self.task is not None else "Ray actor"
        return chain.who(self.hop, self.index).replace("worker", kind, 1)

    def describe(self, chain: Chain) -> str:
        return f"{self.who(chain)} on {self.device}" + (f", {self.where}" if self.where else "")


class ActorPools(Protocol):
    """What a run needs of its engine: the actors of every hop, and fresh ones."""

    chain: Chain
    pools: list[list[Actor]]
    waits: list[bool]  # per hop: its actors run several chunks at once (a pool that waits)

    def replace(self, actor: Actor) -> Actor: ...
    def kill_overdue(self, timeout: float) -> list[tuple[Actor, int]]: ...
    def recycle(self, due: Sequence[Place]) -> None: ...
