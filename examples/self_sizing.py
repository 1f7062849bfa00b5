"""Two pools that size themselves, a stage that becomes 3x slower halfway, and a report.

Run: python examples/self_sizing.py [N_ITEMS] [--trace run.json] [--plot workers.svg]

``fetch`` and ``embed`` wait (they sleep, as a download or a GPU would: no CPU), so a budget
of 6 workers fits on any machine. Each pool is ``.on((1, 6))``: the run starts from an even
split and moves workers to the pool that limits it; when ``embed`` becomes 3x slower halfway
through the input, workers move from ``fetch`` to ``embed``. The result is the same as with
any fixed split. The run prints its report and every resize; ``--trace`` writes the Chrome
trace (open it at https://ui.perfetto.dev), ``--plot`` draws the workers of each pool over
time from the recorded resizes as an SVG (the picture in docs/guide/self-sizing.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from easycore import producer

N = 1200
BUDGET = 6


@producer
def fetch(x: int) -> int:
    time.sleep(0.01)
    return x


@producer
def embed(x: int, *, cfg: Any) -> int:
    time.sleep(0.01 if x < cfg.n // 2 else 0.03)  # 3x slower from the middle on
    return x * 2


def plot(stats: list[Any], seconds: float, path: str) -> None:
    """Workers per pool over time, from the recorded resizes, as a small SVG (no plotting
    library needed)."""
    width, height, pad = 640, 260, 40
    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    x = lambda t: pad + (width - 2 * pad) * t / seconds  # noqa: E731
    y = lambda w: height - pad - (height - 2 * pad) * w / BUDGET  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{pad}" y1="{y(0)}" x2="{width - pad}" y2="{y(0)}" stroke="black"/>',
        f'<line x1="{pad}" y1="{y(0)}" x2="{pad}" y2="{y(BUDGET)}" stroke="black"/>',
        f'<text x="{width / 2 - 30}" y="{height - 8}">seconds ({seconds:.1f} s)</text>',
        f'<text x="4" y="{pad - 12}">workers</text>',
    ]
    for w in range(BUDGET + 1):
        parts.append(f'<text x="{pad - 14}" y="{y(w) + 4}">{w}</text>')
    for k, s in enumerate(stats):
        first = s.resizes[0].before if s.resizes else s.workers
        points, now = [(0.0, first)], first
        for r in s.resizes:
            points += [(r.at, now), (r.at, r.after)]
            now = r.after
        points.append((seconds, now))
        line = " ".join(f"{x(t):.1f},{y(w):.1f}" for t, w in points)
        color = colors[k % len(colors)]
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{width - pad - 90}" y="{pad + 16 * k}" fill="{color}">')
        parts.append(f"{s.name} ({len(s.resizes)} resizes)</text>")
    parts.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", nargs="?", type=int, default=N)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    pipeline = fetch.on((1, BUDGET)) >> embed.on((1, BUDGET))
    with pipeline.open(cfg={"n": args.n}, cpus=BUDGET, trace=args.trace) as runner:
        t0 = time.perf_counter()
        out = list(runner.imap(range(args.n)))
        seconds = time.perf_counter() - t0
        stats, report = runner.stats(), runner.report()
    assert out == [2 * x for x in range(args.n)], "results differ from a fixed split's"
    print(report)
    for s in stats:
        for r in s.resizes:
            print(f"  {r.at:5.2f} s  {s.name}: {r.before} -> {r.after} workers ({r.why})")
    if args.plot:
        plot(stats, seconds, args.plot)
    print(f"{args.n} items in {seconds:.2f} s, the same results as a fixed split: OK")


if __name__ == "__main__":
    main()
