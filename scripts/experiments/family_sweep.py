"""Every family mlx-lm implements that a tiny config builds here, through the engine: a row each.

    python -m scripts.experiments.family_sweep                 # writes docs/bench/family_sweep.txt
    python -m scripts.experiments.family_sweep --only lfm2,gpt2

Per family (``tests/support/mlx_lm_sweep.py``'s config, mlx-lm's class with its default
random weights, saved as a folder and loaded by ``loading.load_model``, float32):

* ``plain``: greedy plain decoding equals mlx-lm's own (its forward over its own caches);
* ``tree``: greedy speculation with a tree shape of lookup chains (``K2xL5``) equals it;
* ``draft``: the model as its own draft model (``D1xL4``) equals it;
* or the load's one-line refusal (``n/a``: mlx-lm's own forward cannot run here). A row
  marked ``WRONG`` decoded a different token, one marked ``CRASH`` raised something else
  than a refusal or ended its process (a signal, ``sys.exit``), one marked ``HANG`` ran
  past ``--timeout``: none may ever be in the table.

Families run in a worker process (``--worker``), one after another; a worker that dies or
hangs is reported in its family's row and a fresh one takes the families left.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

TOKENS = 8
PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 7, 3, 9, 4, 2, 8, 5, 7]
OUT = Path("docs/bench/family_sweep.txt")
TIMEOUT = 300.0  # seconds a family may take (a tiny model takes a few, on a shared CPU)
STATUSES = ("ok", "refused", "n/a", "WRONG", "CRASH", "HANG")


@dataclass
class Row:
    """One family's result: ``status`` ok / refused / WRONG / CRASH, and what was seen."""

    family: str
    status: str
    detail: str
    seconds: float

    def line(self) -> str:
        return f"{self.family:<22} {self.status:<8} {self.detail}"


def build(config: dict):
    """mlx-lm's model of ``config``, its default initialisation (seeded), float32."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    cls, args = _get_classes(config)
    mx.random.seed(0)
    lm = cls(args.from_dict(config))
    lm.set_dtype(mx.float32)
    mx.eval(lm.parameters())
    return lm


def mlx_lm_greedy(lm, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy decoding: its forward over its own prompt cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm)
    logits = lm(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = lm(mx.array([[out[-1]]]), cache=cache)
    return out


def vocab_of(lm) -> int:
    """The rows of mlx-lm's input embedding (configs name the vocabulary differently)."""
    import mlx.nn as nn

    tables = [
        m for _, m in lm.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
    ]
    return max(t.weight.shape[0] for t in tables)


def save(lm, config: dict, path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.parameters())))


def sweep_family(name: str, config: dict, root: Path) -> Row:
    """``name``'s row (see the module docstring)."""
    start = time.perf_counter()
    try:
        status, detail = _run(name, config, root)
    except (Exception, SystemExit) as e:  # the sweep records it; the test fails on it
        first = (str(e).strip().splitlines() or [""])[0][:160]
        status, detail = "CRASH", f"{type(e).__name__}: {first}"
    return Row(name, status, detail, time.perf_counter() - start)


def _run(name: str, config: dict, root: Path) -> tuple[str, str]:
    import mlx.core as mx

    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.loading import LoadError, load_model
    from redrafter_mlx.engine.verifier.refusals import check_family
    from tests.support.models import run_decode

    path = root / name
    try:
        check_family(config["model_type"])
    except ValueError:  # refused before mlx-lm imports or builds it: a config is enough
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config))
        try:
            load_model(path, mx.float32)
        except LoadError as e:
            return "refused", str(e).replace(str(path), "<folder>")
        return "CRASH", "a family refused by name loaded"
    lm = build(config)
    try:
        want = mlx_lm_greedy(lm, [t % vocab_of(lm) for t in PROMPT], TOKENS)
    except Exception as e:  # not a family this machine runs (bitnet's Metal kernel on a CPU)
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return "n/a", f"mlx-lm cannot run it here ({type(e).__name__}: {first})"
    try:
        save(lm, config, path)
        model, _ = load_model(path, mx.float32)
    except (LoadError, ValueError) as e:
        line = str(e).replace(str(path), "<folder>")
        return ("refused" if "\n" not in line else "CRASH"), line
    prompt = [t % vocab_of(lm) for t in PROMPT]
    plain, _ = run_decode(model, None, [prompt], max_tokens=TOKENS)
    if plain[0] != want:
        return "WRONG", f"plain {plain[0]} != mlx-lm {want}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a narrowed family's note
        tree, _ = run_decode(
            model, None, [prompt], max_tokens=TOKENS, shape=BeamShape.parse("K2xL5"), adapt=False
        )
    if tree != plain:
        return "WRONG", f"tree {tree[0]} != plain {plain[0]}"
    notes = [f"verifies {model.verifies}"]
    if model.recurrent:
        notes.append("draft: refused (recurrent)")
    else:
        own, _ = run_decode(
            model, None, [prompt], max_tokens=TOKENS, shape=BeamShape.parse("D1xL4"),
            draft_model=model,
        )  # fmt: skip
        if own != plain:
            return "WRONG", f"own draft {own[0]} != plain {plain[0]}"
        notes.append("draft: ok")
    return "ok", "; ".join(notes)


def worker(names: list[str]) -> None:
    """Each family's row as a JSON line on stdout, in order (``--worker``)."""
    from tests.support.mlx_lm_sweep import CONFIGS

    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = sweep_family(name, CONFIGS[name], Path(tmp))
            print(json.dumps(asdict(row)), flush=True)


def worker_command(names: list[str]) -> list[str]:
    return [sys.executable, "-m", "scripts.experiments.family_sweep", "--worker", ",".join(names)]


def sweep(names=None, timeout: float = TIMEOUT, command=worker_command) -> list[Row]:
    """A row per family of ``names`` (default: every family), in the fixture's order, each
    computed in a worker process ``command(families)``; a worker that ends before a row or
    gives none within ``timeout`` seconds gives its family a ``CRASH`` or ``HANG`` row."""
    from tests.support.mlx_lm_sweep import CONFIGS

    left = [n for n in CONFIGS if names is None or n in names]
    left += sorted(set(names or ()) - set(left))  # not in the fixture: a CRASH row each
    rows = []
    while left:
        for row in _one_worker(list(left), timeout, command):
            rows.append(row)
            left.remove(row.family)
            print(row.line(), f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    return rows


def _one_worker(names: list[str], timeout: float, command):
    """Rows from one worker over ``names``, up to and including the first it fails on."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            command(names), stdout=subprocess.PIPE, stderr=err, text=True, env=_env()
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        for name in names:
            start = time.perf_counter()
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                proc.wait()
                yield Row(name, "HANG", f"no row in {timeout:.0f} s", time.perf_counter() - start)
                return
            if line is None:  # the worker ended before this family's row
                rc = proc.wait()
                why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
                err.seek(0)
                last = ([x for x in err.read().splitlines() if x.strip()] or [""])[-1]
                yield Row(name, "CRASH", f"worker {why}: {last.strip()[:140]}", 0.0)
                return
            row = Row(**json.loads(line))
            row.seconds = time.perf_counter() - start  # as the sweep waited: start-up too
            yield row
        proc.wait()


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        if line.startswith("{"):
            lines.put(line)
    lines.put(None)


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def table(rows: list[Row]) -> str:
    """The committed table: a header line, then a row per family."""
    import mlx_lm

    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    head = (
        f"family sweep, mlx-lm {mlx_lm.__version__}: {len(rows)} families, "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f"; {TOKENS} greedy tokens each (plain = mlx-lm's, K2xL5 tree = plain, own draft "
        "model D1xL4 = plain), or the load's refusal"
    )
    return "\n".join([head, *(r.line() for r in rows)]) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated families (default: all; no file written)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per family")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # families, in this process
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","))
    names = set(args.only.split(",")) if args.only else None
    rows = sweep(names, args.timeout)
    text = table(rows)
    print(text, end="")
    if names is None:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
