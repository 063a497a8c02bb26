"""What tensor parallelism costs in messages: the latency of one ``all_sum`` of a (B, T, H)
hidden state, the message a split model sends twice per layer.

Run on the ranks you will decode with (rank 0 prints)::

    mlx.launch -n 2 --backend ring -- python -m redrafter_mlx.measure.allsum
    mlx.launch --hostfile hosts.json --backend ring -- python -m redrafter_mlx.measure.allsum

Two figures per size, each the fastest run (the latency floor) and the median: ``alone``,
one all_sum evaluated by itself (what a message costs with nothing to overlap), and
``chained``, the per-message time of 2 x ``layers`` all_sums in one graph, each summing the
last one's result, as in a forward (the evaluation's fixed cost shared; the values overflow,
which costs nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

SIZES = [(1, 1), (1, 4), (1, 8), (1, 16), (4, 8)]  # (B, T): AR, short and long trees, a batch


def alone(x: mx.array, group, repeats: int) -> tuple[float, float]:
    """(fastest, median) seconds of one all_sum of ``x``, evaluated by itself."""
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - tic)
    return min(times), statistics.median(times)


def chained(x: mx.array, group, count: int, repeats: int) -> tuple[float, float]:
    """(fastest, median) seconds per all_sum of ``count`` dependent all_sums in one
    evaluation."""

    def run(y):
        for _ in range(count):
            y = mx.distributed.all_sum(y, group=group)
        return y

    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(run(x))
        times.append(time.perf_counter() - tic)
    return min(times) / count, statistics.median(times) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=8192, help="H (8192: a 70B Llama)")
    parser.add_argument("--layers", type=int, default=80, help="layers (2 all_sums each)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    group = mx.distributed.init()
    dtype = getattr(mx, args.dtype)
    rows = []
    for B, T in SIZES:
        x = mx.ones((B, T, args.hidden), dtype)
        alone(x, group, 5)  # warm the connections
        a = alone(x, group, args.repeats)
        c = chained(x, group, 2 * args.layers, max(3, args.repeats // 10))
        rows.append((B, T, x.nbytes, a, c))
    if group.rank() == 0:
        print(f"all_sum over {group.size()} ranks, H={args.hidden} {args.dtype}")
        print("microseconds per all_sum, fastest / median")
        print(f"{'B':>3} {'T':>3} {'bytes':>8} {'alone':>13} {'chained':>13}")
        for B, T, nbytes, a, c in rows:
            print(f"{B:>3} {T:>3} {nbytes:>8} {_us(a):>13} {_us(c):>13}")


def _us(pair: tuple[float, float]) -> str:
    return f"{pair[0] * 1e6:.0f} / {pair[1] * 1e6:.0f}"


if __name__ == "__main__":
    main()
