"""Benchmark ``redrafter-mlx serve``: N concurrent requests, per server mode, side by side.

    python -m scripts.bench_serve                       # demo model, N = 1, 2, 4, 8
    python -m scripts.bench_serve --concurrency 1,4 --requests 8 --max-tokens 64
    python -m scripts.bench_serve --prompts edit --modes adaptive,pinned,ar
    python -m scripts.bench_serve --url http://127.0.0.1:8080   # an already running server

Without ``--url`` it starts the server once per ``--modes`` entry on a free localhost port:
``adaptive`` (serve's default: each step's shape chosen), ``pinned`` (``--no-adapt``: one
shape for every step) and ``ar`` (``--no-draft --no-lookup``: plain decoding), passing
``--model``/``--drafter``/beam flags through. Each level runs N closed-loop clients until
``--requests`` greedy requests (first turns of ``--prompts``, spread over its categories,
chat format, no repetition penalty whatever the model's generation_config says) are done,
after one warm-up request. Reports aggregate generated tokens/s (all clients, wall clock)
and its ratio to the ``ar`` row at the same N, p50/p95 request
latency, mean server-side time to first token and tokens per step, the mean batch rows per
step, and the share of accepted drafts that came from lookup. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
from rich.console import Console
from rich.table import Table

from redrafter_mlx.engine.base.prompts import load_records

MODES = {  # serve flags per mode
    "adaptive": [],
    "pinned": ["--no-adapt"],
    "ar": ["--no-draft", "--no-lookup"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, mode: str) -> tuple[subprocess.Popen, str]:
    """``redrafter-mlx serve`` on a free port; returns (process, base url) once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--port", str(port)]
    cmd += ["--max-batch", str(args.max_batch), "--log-level", "warning"]
    for flag in ("model", "drafter", "beam_width", "beam_length", "capacity", "lookup"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_lookup and mode != "ar":
        cmd.append("--no-lookup")
    cmd += MODES[mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start in 300 s")


def one_request(client, prompt: str, max_tokens: int) -> dict:
    tic = time.perf_counter()
    resp = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"repetition_penalty": 1.0},  # greedy as `bench` runs it, not the model's
    )
    spec = resp.model_extra.get("speculation", {})
    return dict(
        latency=time.perf_counter() - tic,
        tokens=resp.usage.completion_tokens,
        ttft=spec.get("time_to_first_token", 0.0),
        tokens_per_step=spec.get("tokens_per_step", 1.0),
        steps=spec.get("steps", 0),
        accepted=spec.get("accepted_draft_tokens", 0),
        from_lookup=spec.get("accepted_from_lookup", 0),
        label=_label(spec),
    )


def _label(spec: dict) -> str:
    if not spec.get("enabled"):
        return "AR"
    shape = f"W{spec['beam_width']}×L{spec['beam_length']}" if spec["beam_width"] else ""
    if spec.get("lookup"):
        shape += ("+" if shape else "") + f"K{spec['lookup']}×L{spec['lookup_length']}"
    return ("adaptive " if spec.get("adaptive") else "") + f"{shape} C{spec['capacity']}"


def run_level(url: str, prompts: list[str], n: int, requests: int, max_tokens: int) -> dict:
    """N closed-loop clients until ``requests`` are done; aggregate and latency figures."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    todo = iter(range(requests))
    lock = threading.Lock()
    results = []

    def worker():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = one_request(client, prompts[i % len(prompts)], max_tokens)
            with lock:
                results.append(r)

    tic = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    latencies = sorted(r["latency"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    return dict(
        n=n,
        requests=len(results),
        tokens=tokens,
        wall=wall,
        tps=tokens / wall,
        p50=statistics.median(latencies),
        p95=latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        ttft=statistics.mean(r["ttft"] for r in results),
        tokens_per_step=sum(r["tokens_per_step"] * r["steps"] for r in results) / max(steps, 1),
        lookup_share=sum(r["from_lookup"] for r in results)
        / max(sum(r["accepted"] for r in results), 1),
        label=results[0]["label"],
    )


def bench_server(url: str, args, prompts: list[str], mode: str) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    one_request(client, prompts[0], 16)  # warm-up: compile each batch size used below
    for n in args.concurrency:
        run_level(url, prompts, n, n, 16)
    rows = []
    for n in args.concurrency:
        before = httpx.get(url + "/health").json()
        row = run_level(url, prompts, n, max(args.requests, n), args.max_tokens)
        after = httpx.get(url + "/health").json()
        steps = after["steps"] - before["steps"]
        row["rows_per_step"] = (after["row_steps"] - before["row_steps"]) / max(steps, 1)
        row["mode"] = mode
        shapes = after.get("shape_steps", {})
        ran = {k: v - before.get("shape_steps", {}).get(k, 0) for k, v in shapes.items()}
        row["shapes"] = {k: v for k, v in sorted(ran.items(), key=lambda kv: -kv[1]) if v}
        rows.append(row)
        print(f"  {row['label']} N={n}: {row['tps']:.1f} tok/s", file=sys.stderr)
    return rows


def render(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "mode",
        "N",
        "requests",
        "tokens",
        "wall s",
        "agg tok/s",
        "p50 s",
        "p95 s",
        "TTFT s",
        "vs AR",
        "tok/step",
        "lookup share",
        "rows/step",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ar = {r["n"]: r["tps"] for r in rows if r.get("mode") == "ar"}
    for r in rows:
        ratio = f"{r['tps'] / ar[r['n']]:.2f}×" if r["n"] in ar else "–"
        table.add_row(
            r["label"],
            str(r["n"]),
            str(r["requests"]),
            str(r["tokens"]),
            f"{r['wall']:.1f}",
            f"{r['tps']:.1f}",
            f"{r['p50']:.2f}",
            f"{r['p95']:.2f}",
            f"{r['ttft']:.3f}",
            ratio,
            f"{r['tokens_per_step']:.2f}",
            f"{r['lookup_share']:.0%}",
            f"{r['rows_per_step']:.2f}",
        )
    return table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark this running server instead of starting two")
    p.add_argument("--model")
    p.add_argument("--drafter")
    p.add_argument("--beam-width", type=int)
    p.add_argument("--beam-length", type=int)
    p.add_argument("--capacity", type=int)
    p.add_argument("--lookup", type=int)
    p.add_argument("--no-lookup", action="store_true")
    p.add_argument("--prompts", default="mt-bench", help="prompt set or file (first turns)")
    p.add_argument("--modes", default="adaptive,ar", help="comma-separated: " + ",".join(MODES))
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated N values")
    p.add_argument("--requests", type=int, default=16, help="requests per level (>= N)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown --modes {bad}; choose from {', '.join(MODES)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    count = max(args.requests, max(args.concurrency))
    prompts = [r.prompt for r in load_records(args.prompts, count, spread_categories=True)]
    rows = []
    if args.url:
        rows = bench_server(args.url.rstrip("/"), args, prompts, "server")
    else:
        for mode in args.modes:
            proc, url = start_server(args, mode)
            try:
                rows += bench_server(url, args, prompts, mode)
            finally:
                proc.terminate()
                proc.wait(30)
    title = (
        f"redrafter-mlx serve · {args.model or 'demo model'} · greedy, "
        f"{args.max_tokens} max tokens, {args.prompts} first turns ({len(prompts)})"
    )
    console = Console(width=max(Console().width, 160))
    console.print(render(rows, title))
    for r in rows:
        if r.get("shapes"):
            shown = ", ".join(f"{k} {v}" for k, v in r["shapes"].items())
            console.print(f"[dim]{r['label']} N={r['n']}: steps per shape: {shown}[/]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
