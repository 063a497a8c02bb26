"""Every family mlx-lm implements that a tiny config builds here, through the engine: a row each.

    python -m scripts.experiments.family_sweep                 # writes docs/bench/family_sweep.txt
    python -m scripts.experiments.family_sweep --only lfm2,gpt2

Per family (``tests/fixtures/mlx_lm_sweep.py``'s config, mlx-lm's class with its default
random weights, saved as a folder and loaded by ``loading.load_model``, float32):

* ``plain``: greedy plain decoding equals mlx-lm's own (its forward over its own caches);
* ``tree``: greedy speculation with a tree shape of lookup chains (``K2xL5``) equals it;
* ``draft``: the model as its own draft model (``D1xL4``) equals it;
* or the load's one-line refusal (``n/a``: mlx-lm's own forward cannot run here). A row
  marked ``WRONG`` decoded a different token, one marked ``CRASH`` raised something else
  than a refusal: neither may ever be in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

TOKENS = 8
PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 7, 3, 9, 4, 2, 8, 5, 7]
OUT = Path("docs/bench/family_sweep.txt")


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
    except Exception as e:  # the sweep records it; the test fails on it
        first = (str(e).strip().splitlines() or [""])[0][:160]
        status, detail = "CRASH", f"{type(e).__name__}: {first}"
    return Row(name, status, detail, time.perf_counter() - start)


def _run(name: str, config: dict, root: Path) -> tuple[str, str]:
    import mlx.core as mx

    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.loading import LoadError, load_model
    from redrafter_mlx.engine.verifier.refusals import BY_NAME
    from tests.helpers import run_decode

    path = root / name
    lm = build(config)
    if name in BY_NAME:  # refused before any forward: mlx-lm's own may write out of bounds
        save(lm, config, path)
        try:
            load_model(path, mx.float32)
        except LoadError as e:
            return "refused", str(e).replace(str(path), "<folder>")
        return "CRASH", "a family refused by name loaded"
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


def sweep(names=None) -> list[Row]:
    from tests.fixtures.mlx_lm_sweep import CONFIGS

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            if names is None or name in names:
                rows.append(sweep_family(name, config, Path(tmp)))
                print(rows[-1].line(), f"({rows[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row]) -> str:
    """The committed table: a header line, then a row per family."""
    import mlx_lm

    counts = {
        s: sum(r.status == s for r in rows) for s in ("ok", "refused", "n/a", "WRONG", "CRASH")
    }
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
    args = parser.parse_args(argv)
    names = set(args.only.split(",")) if args.only else None
    rows = sweep(names)
    text = table(rows)
    print(text, end="")
    if names is None:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
