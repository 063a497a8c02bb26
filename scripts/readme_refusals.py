"""The README's list of refused families, rendered from the code's own refusals as the family
sweep finds them (``docs/bench/family_sweep.txt``: each refused row is the load's one-line
message) and the converter's table (``verifier.config.SUPPORTED_MODEL_TYPES``).

    python -m scripts.readme_refusals          # rewrites the README's section in place
    python -m scripts.readme_refusals --check  # exit 1 if the README differs

``tests/test_readme_refusals.py`` keeps the README equal to ``render()``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path("README.md")
SWEEP = Path("docs/bench/family_sweep.txt")
BEGIN = "<!-- refused families: python -m scripts.readme_refusals writes this section -->"
END = "<!-- end of refused families -->"


def rows(text: str) -> list[tuple[str, str, str]]:
    """``(family, status, detail)`` of each row of a sweep table (after its header line)."""
    out = []
    for line in text.splitlines()[1:]:
        family, status, *detail = line.split(maxsplit=2)
        out.append((family, status, detail[0] if detail else ""))
    return out


def reason(family: str, detail: str) -> str:
    """A refusal's message without its folder and family: what the families share."""
    text = detail.removeprefix("<folder>: ")
    text = re.sub(rf"^model_type '{re.escape(family)}'(:| cannot be sped up yet:)? ", "", text)
    return text.rstrip(".")


def render(sweep_text: str) -> str:
    """The README section (between ``BEGIN`` and ``END``, both included)."""
    from redrafter_mlx.engine.verifier.config import SUPPORTED_MODEL_TYPES

    table = rows(sweep_text)
    by_reason: dict[str, list[str]] = {}
    for family, status, detail in table:
        if status == "refused":
            by_reason.setdefault(reason(family, detail), []).append(family)
    runs = sum(status == "ok" for _, status, _ in table)
    untested = [family for family, status, _ in table if status == "n/a"]
    lines = [
        BEGIN,
        f"Of the {len(table)} families the family sweep builds tiny models of "
        f"([docs/bench/family_sweep.txt](docs/bench/family_sweep.txt)), {runs} decode plain "
        f"decoding's tokens speculating; {sum(map(len, by_reason.values()))} are refused at "
        "load, each in one line saying why:",
    ]
    for why, families in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        lines.append(f"- {', '.join(f'`{f}`' for f in families)}: {why};")
    if untested:
        names = ", ".join(f"`{f}`" for f in untested)
        lines.append(f"- not run here (mlx-lm's own forward cannot run on this machine): {names}.")
    lines += [
        "",
        f"`redrafter-mlx convert` takes {len(SUPPORTED_MODEL_TYPES)} families "
        f"({', '.join(f'`{f}`' for f in SUPPORTED_MODEL_TYPES)}); for every other family its "
        "refusal names `mlx_lm convert --hf-path SRC --mlx-path DIR`, whose output loads here.",
        END,
    ]
    return "\n".join(lines)


def with_section(readme: str, section: str) -> str:
    """``readme`` with its section replaced by ``section``."""
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + section + readme[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README differs")
    args = parser.parse_args(argv)
    old = README.read_text()
    new = with_section(old, render(SWEEP.read_text()))
    if args.check:
        return int(new != old)
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
