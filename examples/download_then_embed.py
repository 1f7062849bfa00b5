"""Download images with many requests in flight, decode them on CPU workers, embed them with
a small model: a stage that waits, a stage that computes, a stage on the accelerator.

Run: python examples/download_then_embed.py [N_IMAGES]

The example starts its own HTTP server on localhost serving JPEGs (made with Pillow), which
answers each request after 20 ms, like a slow object store. ``fetch`` is an ``async def``
producer: with ``.on(2, concurrency=32)`` each of its 2 workers holds 32 downloads at once on
one event loop, so 64 requests are in flight. One request in 10 fails once with a 500:
``retries=2`` rides it out per item. ``decode`` turns bytes into tensors on CPU workers;
``embed`` runs a small CNN on batches on the GPU (or a CPU worker). Results come back in
input order, and a seeded run gives the same embeddings as an inline run.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

from easycore import consumer, producer

SIZE = 64  # images are SIZE x SIZE RGB
DIM = 32  # embedding size
DELAY = 0.02  # seconds the server takes per request


# -- a local image server (stands in for S3, a CDN, an HTTP API) ------------------------------
def jpeg(i: int) -> bytes:
    """Image ``i``: a deterministic colour pattern, JPEG-encoded."""
    rng = np.random.default_rng(i)
    pixels = (rng.random((SIZE, SIZE, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the default (5) would refuse most of a burst of requests


def start_server(n: int) -> tuple[ThreadingHTTPServer, str]:
    images = {i: jpeg(i) for i in range(n)}
    asked: dict[int, int] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            i = int(urllib.parse.urlsplit(self.path).path.rsplit("/", 1)[-1].split(".")[0])
            with lock:
                asked[i] = asked.get(i, 0) + 1
                first = asked[i] == 1
            time.sleep(DELAY)
            if i % 10 == 3 and first:  # a flaky server: fails some requests once
                self.send_error(500)
                return
            body = images[i]
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# -- the pipeline ------------------------------------------------------------------------------
async def http_get(url: str) -> bytes:
    """GET with asyncio streams (any async client works the same: httpx, aiohttp...)."""
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(f"GET {parts.path} HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        msg = f"{url}: HTTP {status}"
        raise OSError(msg)
    return body


@producer
async def fetch(url: str) -> bytes:
    return await http_get(url)


@producer
def decode(data: bytes) -> torch.Tensor:
    img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(img.transpose(2, 0, 1).copy())


def load_model(device):
    torch.manual_seed(0)  # the same weights in every worker
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, DIM, 3, stride=2, padding=1),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    )
    return model.to(device).eval()


@producer(init=load_model)
@torch.no_grad()
def embed(images: list[torch.Tensor], *, state, device) -> torch.Tensor:
    return state(torch.stack(images).to(device)).cpu()


@consumer(init=list, end=torch.cat)
def collect(parts, batch):
    parts.append(batch)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    server, base = start_server(n)
    urls = [f"{base}/images/{i}.jpg" for i in range(n)]
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    decoders = max(1, min(4, len(os.sched_getaffinity(0)) - 1))
    pipeline = (
        fetch.on(2, concurrency=32)
        >> decode.on(decoders)
        >> embed.on(gpus[:1] or ["cpu"], batch_size=32)
        >> collect
    )
    print(f"pipeline: {pipeline}")
    try:
        t0 = time.perf_counter()
        embeddings = pipeline.map(urls, retries=2)
        took = time.perf_counter() - t0
        print(f"embeddings: {tuple(embeddings.shape)}")
        print(
            f"throughput: {n / took:,.0f} images/s ({took:.2f} s for {n} images; one at a "
            f"time would take over {n * DELAY:.0f} s of waiting alone)"
        )
        inline = pipeline.map(urls[:50], devices="inline", retries=2)
        assert torch.allclose(inline, embeddings[:50], atol=1e-5), "the runs disagree"
        print("inline run agrees: OK")
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
