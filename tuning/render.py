"""Terminal and PNG output of a tuning run: results table and W x L heatmaps.

The heatmap follows Figure 7 of the ReDrafter paper: rows are beam lengths L, columns
beam widths W, each cell colored by the speedup over autoregressive decoding and showing
tokens/s and the speedup. When several variants of one (W, L) were tried (capacities,
context-lookup chains added), the cell shows the best and names its capacity and chains.
Lookup-only shapes (no drafter beam) have no cell: they are in the results table only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuning.search import SearchResult, ShapeResult

if TYPE_CHECKING:  # rich is imported lazily to keep `import redrafter_mlx.cli.tune` cheap
    from rich.table import Table


def _lerp(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    """Linear blend of two RGB colors, ``t`` in [0, 1]."""
    t = min(max(t, 0.0), 1.0)
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b))  # type: ignore[return-value]


_RED, _NEUTRAL, _GREEN = (200, 60, 60), (235, 225, 160), (40, 170, 80)


def speedup_rgb(speedup: float, best: float) -> tuple[int, int, int]:
    """Red below 1x, pale yellow at 1x, green at the best speedup of the grid."""
    if speedup < 1.0:
        return _lerp(_NEUTRAL, _RED, (1.0 - speedup) / 0.5)
    return _lerp(_NEUTRAL, _GREEN, (speedup - 1.0) / max(best - 1.0, 1e-9))


def heatmap_cells(result: SearchResult) -> dict[tuple[int, int], ShapeResult]:
    """The best measured result for every (width, length) cell of the grid (drafter shapes,
    with or without lookup chains)."""
    cells: dict[tuple[int, int], ShapeResult] = {}
    for r in result.results:
        if not r.measured or not r.shape.drafts:
            continue
        key = (r.shape.width, r.shape.length)
        current = cells.get(key)
        if current is None or result.speedup(r).median > result.speedup(current).median:
            cells[key] = r
    return cells


def _axes(result: SearchResult) -> tuple[list[int], list[int]]:
    """Sorted widths and lengths of the searched grid's drafter shapes."""
    widths = sorted({r.shape.width for r in result.results if r.shape.drafts})
    lengths = sorted({r.shape.length for r in result.results if r.shape.drafts})
    return widths, lengths


def has_heatmap(result: SearchResult) -> bool:
    """True when the grid has drafter shapes (a lookup-only search has no W x L map)."""
    return any(r.shape.drafts for r in result.results)


def variant_note(r: ShapeResult) -> str:
    """What a cell's best shape adds to its W x L: `` C12``, `` +K1×L8``, both, or nothing."""
    shape = r.shape
    note = f" +K{shape.lookup}×L{shape.chain_length}" if shape.lookup else ""
    return note + (f" C{shape.capacity}" if shape.capacity is not None else "")


def heatmap_table(result: SearchResult) -> Table:
    """A rich table: rows L, columns W, colored cells with tokens/s and speedup."""
    from rich.color import Color
    from rich.style import Style
    from rich.table import Table

    widths, lengths = _axes(result)
    cells = heatmap_cells(result)
    best = max((result.speedup(r).median for r in cells.values()), default=1.0)
    ar_tps = result.autoregressive.spread().median if result.autoregressive.measured else 0.0
    lookup = any(r.shape.lookup for r in result.results)
    table = Table(
        title=f"tokens/s and speedup over autoregressive ({ar_tps:.1f} tok/s)",
        caption="each cell: its best variant (+K: with lookup chains); lookup alone: the table"
        if lookup
        else None,
        show_lines=True,
    )
    table.add_column("L \\ W", justify="right", style="bold")
    for w in widths:
        table.add_column(f"W={w}", justify="center")
    for length in lengths:
        row = []
        for w in widths:
            r = cells.get((w, length))
            if r is None:
                row.append("–")
                continue
            speed = result.speedup(r).median
            note = variant_note(r)
            mark = "★ " if r.shape == result.recommended else ""
            style = Style(color="black", bgcolor=Color.from_rgb(*speedup_rgb(speed, best)))
            row.append((f"{mark}{r.spread().median:.1f}{note}\n{speed:.2f}×", style))
        table.add_row(f"L={length}", *[_cell(c) for c in row])
    return table


def _cell(cell):
    """A rich Text for a (text, style) pair, or the plain string."""
    from rich.text import Text

    if isinstance(cell, tuple):
        return Text(cell[0], style=cell[1], justify="center")
    return cell


def _fmt_spread(lo: float, hi: float, digits: int = 1) -> str:
    """``"12.3–14.0"``."""
    return f"{lo:.{digits}f}–{hi:.{digits}f}"


def results_table(result: SearchResult) -> Table:
    """Every shape with its median tokens/s, IQR, range, speedup and how often it ran."""
    from rich.table import Table

    table = Table(title="measured shapes (median, IQR and range over prompts and repeats)")
    for name in ("shape", "tok/s", "IQR", "min–max", "speedup (IQR)", "tok/step", "runs×tok"):
        table.add_column(name, justify="left" if name == "shape" else "right")
    rows = [
        result.autoregressive,
        *sorted((r for r in result.results if r.measured), key=lambda r: -result.speedup(r).median),
    ]
    for r in rows:
        s, sp = r.spread(), result.speedup(r)
        per_step = (
            f"{sum(r.tokens_per_step) / len(r.tokens_per_step):.2f}" if r.tokens_per_step else ""
        )
        label = ("★ " if r.shape == result.recommended else "") + r.shape.label
        speedup = f"{sp.median:.2f}× ({_fmt_spread(sp.q1, sp.q3, 2)})"
        table.add_row(
            label,
            f"{s.median:.1f}",
            _fmt_spread(s.q1, s.q3),
            _fmt_spread(s.low, s.high),
            speedup,
            per_step,
            f"{r.runs}×{r.final_tokens}",
        )
    failed = [r for r in result.results if r.error]
    for r in failed:
        table.add_row(r.shape.label, "failed", r.error or "", "", "", "", "")
    return table


def save_heatmap_png(result: SearchResult, path: str) -> None:
    """Write the speedup heatmap to ``path`` with matplotlib (the optional ``plot`` extra).

    Raises RuntimeError with the install command when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'redrafter-mlx[plot]' (or pip install matplotlib)"
        ) from None
    widths, lengths = _axes(result)
    cells = heatmap_cells(result)
    if not cells:
        raise ValueError("no drafter shape was measured, so there is no W x L heatmap to plot")
    grid = [
        [result.speedup(cells[(w, n)]).median if (w, n) in cells else float("nan") for w in widths]
        for n in lengths
    ]
    fig, ax = plt.subplots(figsize=(1.2 * len(widths) + 2, 0.8 * len(lengths) + 1.5))
    values = [v for row in grid for v in row if v == v]  # v == v drops NaN
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min([0.5, *values]), vmax=max([1.5, *values]))
    image = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower")
    for i, n in enumerate(lengths):
        for j, w in enumerate(widths):
            if (w, n) in cells:
                r = cells[(w, n)]
                ax.text(
                    j,
                    i,
                    f"{r.spread().median:.1f}{variant_note(r)}\n{grid[i][j]:.2f}×",
                    ha="center",
                    va="center",
                    fontsize=8,
                )
    ax.set_xticks(range(len(widths)), [str(w) for w in widths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("beam width W")
    ax.set_ylabel("beam length L")
    ax.set_title("speedup over autoregressive decoding")
    fig.colorbar(image, ax=ax, label="speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
