"""The README's list of refused families is what the code refuses (issue 68, item 6): it is
``scripts.readme_refusals.render`` of the committed family sweep (each refused row the load's
own one-line message), and that sweep covers every family refused by name."""

from __future__ import annotations

from redrafter_mlx.engine.verifier.config import SUPPORTED_MODEL_TYPES
from redrafter_mlx.engine.verifier.refusals import BY_NAME, NEEDS, missing_package
from scripts.readme_refusals import BEGIN, END, README, SWEEP, render, rows, with_section


def test_the_readme_lists_the_refused_families_as_the_sweep_finds_them():
    readme = README.read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    assert with_section(readme, render(SWEEP.read_text())) == readme, (
        "README.md's refused families differ from the sweep: run python -m scripts.readme_refusals"
    )


def test_every_family_refused_by_name_is_in_the_sweep_with_the_codes_reason():
    table = {family: (status, detail) for family, status, detail in rows(SWEEP.read_text())}
    for family, why in BY_NAME.items():
        assert table[family][0] == "refused" and why in table[family][1], family
    for family, (_, package) in NEEDS.items():
        if missing_package(family):
            assert table[family][0] == "refused" and package in table[family][1], family


def test_the_readme_no_longer_names_one_recurrent_refusal_or_hides_the_converters_families():
    section = README.read_text().split(BEGIN)[1].split(END)[0]
    assert "`nemotron_h`" in section and "`mamba`" in section and "`rwkv7`" in section
    assert f"takes {len(SUPPORTED_MODEL_TYPES)} families" in section
