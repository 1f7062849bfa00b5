"""W8: a stage that waits on the network, then a CPU step (issue 25).

``n`` requests (2,000) to a local HTTP server that answers each after 20 ms, then a 1 ms CPU
step per answer (a busy loop). The server is an asyncio server in a process of its own
(started before the clock, so its CPU is not the measured process's); every library gets
the same requests and the result (``2 * i`` for request ``i``, in order) is checked.

Rows (``run.py --only W8``):

* ``limit``: one process, ``asyncio.gather`` of every request under a semaphore of 128,
  then the CPU step over the answers: the floor a careful hand-written program reaches;
* ``threads``: ``ThreadPoolExecutor(128).map`` of request-then-step (``http.client``);
* ``easycore``: ``(fetch.on(2, concurrency=64) >> step.on(1)).map(urls)`` with ``fetch`` an
  ``async def`` producer: fresh workers, their start inside the clock (``mode=call``);
* ``easycore concurrency=1`` (``part=10``): the same with one request at a time per worker,
  timed on an open runner (start-up excluded) over a tenth of the requests and scaled by 10;
* ``stage=fetch,runner=1``: the fetch pool alone on an open runner (start-up excluded, as
  for the c=1 rows), at concurrency 64 and 1 (a tenth, scaled). With the step, 2,000
  requests at one at a time on 2 workers take 20 s and the step alone 2 s, so no
  concurrency can be more than 10x faster than concurrency=1 there: the 20x the issue asks
  for is measured on the stage that waits;
* on a local Ray (3 CPUs): easycore ``engine="ray"`` and Ray Data with an async callable
  class (``async def __call__`` yielding each batch's answers, fetched under ``gather``)
  on 2 actors, then the step on 1 actor, order preserved.

``W8 uneven`` (``uneven=1``): each request waits its own time (exponentially distributed,
mean 20 ms: :func:`uneven_delays`) and there is no CPU step: the limit, the threads and
easycore's fetch pool on an open runner (``prefetch=2`` and ``8``).

For ``run.py --one`` only: ``ordered=0`` (easycore on an open runner: results as they
finish, checked sorted) and ``sleep=1`` (each wait an ``asyncio.sleep``, no request: the
scheduling alone, where the HTTP work would make a small machine's CPU the bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import random
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from easycore import producer

W8_DELAY = 0.02  # seconds the server takes per request
W8_STEP = 0.001  # seconds of CPU per answer
W8_LIMIT = 128  # requests in flight for the hand-written peers


# -- the server (its own process: `python bench_waiting.py --serve`) ----------------------------
async def _serve() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path, _, query = head.split(b" ", 2)[1].decode().partition("?")
            body = path.rsplit("/", 1)[-1].encode()
            # (``?d=s``: this request's own wait, for the uneven rows)
            await asyncio.sleep(float(query[2:]) if query.startswith("d=") else W8_DELAY)
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def start_server() -> tuple[subprocess.Popen[str], str]:
    """The server process and its base URL."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


# -- the work ------------------------------------------------------------------------------------
async def aget(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "sleep":  # (``sleep=1``: the wait without the network)
        await asyncio.sleep(float(parts.query[2:] or W8_DELAY))
        return int(parts.path.rsplit("/", 1)[-1])
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.0 200"):
        msg = f"{url}: {head[:40]!r}"
        raise OSError(msg)
    return int(body)


def get(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "sleep":
        time.sleep(float(parts.query[2:] or W8_DELAY))
        return int(parts.path.rsplit("/", 1)[-1])
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
        answer = conn.getresponse()
        if answer.status != 200:
            msg = f"{url}: HTTP {answer.status}"
            raise OSError(msg)
        return int(answer.read())
    finally:
        conn.close()


def cpu_step(x: int) -> int:
    """About 1 ms of CPU (a busy loop), then ``2 * x``."""
    end = time.perf_counter() + W8_STEP
    while time.perf_counter() < end:
        pass
    return 2 * x


@producer
async def fetch(url: str) -> int:
    return await aget(url)


@producer
def step(x: int) -> int:
    return cpu_step(x)


# -- the rows --------------------------------------------------------------------------------------
def uneven_delays(n: int) -> list[float]:
    """The waits of the uneven rows: exponentially distributed, mean ``W8_DELAY`` (seeded:
    the same for every library)."""
    rng = random.Random(8)
    return [rng.expovariate(1 / W8_DELAY) for _ in range(n)]


def _limit(urls: Sequence[str], steps: bool = True) -> list[int]:
    async def everything() -> list[int]:
        gate = asyncio.Semaphore(W8_LIMIT)

        async def one(url: str) -> int:
            async with gate:
                return await aget(url)

        return list(await asyncio.gather(*(one(u) for u in urls)))

    got = asyncio.run(everything())
    return [cpu_step(x) for x in got] if steps else got


def _threads(urls: Sequence[str], steps: bool = True) -> list[int]:
    with ThreadPoolExecutor(W8_LIMIT) as pool:
        return list(pool.map(lambda u: cpu_step(get(u)) if steps else get(u), urls))


def _spdl(urls: Sequence[str], steps: bool = True) -> list[int]:
    """SPDL as its docs advise for I/O: the async request on its event loop (128 at once,
    as the hand-written rows), then the step on the pipeline's one thread, order kept."""
    from spdl.pipeline import PipelineBuilder

    b = PipelineBuilder().add_source(urls).pipe(aget, concurrency=W8_LIMIT, output_order="input")
    if steps:
        b = b.pipe(cpu_step, output_order="input")
    pipeline = b.add_sink(W8_LIMIT).build(num_threads=1)
    with pipeline.auto_stop():
        return list(pipeline.get_iterator())


def _fetch_step(url: str) -> int:
    return cpu_step(get(url))


def _torchdata(urls: Sequence[str], steps: bool = True) -> list[int]:
    """torchdata.nodes as its docs advise for I/O: ``ParallelMapper(method="thread")`` with
    128 threads (request, then step), in order."""
    from torchdata import nodes

    fn = _fetch_step if steps else get
    node = nodes.ParallelMapper(nodes.IterableWrapper(urls), fn, W8_LIMIT, method="thread")
    return list(nodes.Loader(node))


def _pipeline(k: int, fetch_only: bool = False) -> Any:
    if fetch_only:
        return fetch.on(2, concurrency=k)
    return fetch.on(2, concurrency=k) >> step.on(1)


class _AsyncFetch:
    """Ray Data's async callable class: each batch's requests under gather."""

    async def __call__(self, batch: dict[str, Any]) -> Any:
        import numpy as np

        got = await asyncio.gather(*(aget(str(u)) for u in batch["url"]))
        yield {"x": np.asarray(got)}


class _Step:
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        return {"y": np.asarray([cpu_step(int(x)) for x in batch["x"]])}


def _raydata(urls: Sequence[str], batch: int) -> list[int]:
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ds = ray.data.from_items([{"url": u} for u in urls])
    ds = ds.map_batches(_AsyncFetch, concurrency=2, batch_size=batch)
    ds = ds.map_batches(_Step, concurrency=1, batch_size=batch)
    return [int(r["y"]) for r in ds.iter_rows()]


def measure(lib: str, opts: dict[str, str], n: int, workers: int) -> dict[str, Any]:
    """Time one run of W8 on ``lib``; ``{"seconds", "n", "extra"}`` (checked)."""
    del workers  # W8's layout is fixed by the issue: 2 fetch workers, 1 step worker
    server, base = start_server()
    ray_up = False
    try:
        uneven = "uneven" in opts  # exponential waits, and no CPU step
        urls = [f"{base}/v/{i}" for i in range(n)]
        if "sleep" in opts:  # each wait an asyncio.sleep (time.sleep), no request
            urls = [f"sleep://v/{i}" for i in range(n)]
        if uneven:
            urls = [f"{u}?d={d:.5f}" for u, d in zip(urls, uneven_delays(n), strict=True)]
        warm = urls[: max(64, n // 20)]
        extra: dict[str, Any] = {}
        fetch_only = opts.get("stage") == "fetch" or uneven
        times = 1 if fetch_only else 2
        if lib in ("raydata",) or opts.get("engine") == "ray":
            import ray

            ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR")
            ray_up = True
        if lib == "limit":
            _limit(warm, not uneven)
            t0 = time.perf_counter()
            result = _limit(urls, not uneven)
        elif lib == "threads":
            _threads(warm, not uneven)
            t0 = time.perf_counter()
            result = _threads(urls, not uneven)
        elif lib in ("spdl", "torchdata"):
            run = _spdl if lib == "spdl" else _torchdata
            run(warm, not uneven)
            t0 = time.perf_counter()
            result = run(urls, not uneven)
        elif lib == "raydata":
            batch = int(opts.get("batch_size", 64))
            _raydata(warm, batch)
            t0 = time.perf_counter()
            result = _raydata(urls, batch)
        elif lib == "easycore":
            k = int(opts.get("concurrency", 64))
            kw = {"engine": "ray"} if opts.get("engine") == "ray" else {}
            part = int(opts.get("part", 1))
            pipeline = _pipeline(k, fetch_only)
            if part > 1 or "runner" in opts:  # on an open runner (a share of it, scaled)
                prefetch = {"prefetch": int(opts["prefetch"])} if "prefetch" in opts else {}
                ordered = opts.get("ordered", "1") == "1"
                with pipeline.open(**kw, **prefetch) as runner:
                    runner.map(warm[:8])
                    some = urls[: n // part]
                    t0 = time.perf_counter()
                    got = runner.map(some, ordered=ordered)
                    seconds = (time.perf_counter() - t0) * part
                got = got if ordered else sorted(got)
                assert got == [times * i for i in range(len(some))], "wrong result"
                extra["scaled_from"] = len(some)
                return {"seconds": seconds, "n": n, "extra": extra}
            pipeline.map(warm, **kw)
            t0 = time.perf_counter()
            result = pipeline.map(urls, **kw)
        else:
            msg = f"W8 has no library {lib!r}"
            raise ValueError(msg)
        seconds = time.perf_counter() - t0
    finally:
        if ray_up:
            import ray

            ray.shutdown()
        server.kill()
        server.wait()
    if result != [times * i for i in range(n)]:
        import bench_workloads as wl

        msg = f"W8: {lib} returned a wrong result"
        raise wl.WrongResult(msg)
    return {"seconds": seconds, "n": n, "extra": extra}


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve())
    os._exit(0)
