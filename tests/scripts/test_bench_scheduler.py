"""``scripts/bench_scheduler.py`` with ``--branches both``: one table of throughput and latency
per mode, branch setting and concurrency, on the demo model marked as an APAR model (forks
forced by a logit bias)."""

import re

from scripts import bench_scheduler


def test_branches_on_and_off_at_two_concurrencies_in_one_table(apar_folder, capsys):
    args = ["--model", str(apar_folder), "--prompts", "demo", "--num-prompts", "2"]
    args += ["--concurrency", "1,2", "--rounds", "1", "--max-tokens", "8", "--modes", "AR"]
    bench_scheduler.main([*args, "--branches", "both", "--logit-bias", "4094:40"])
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 12 and cells[0] == "AR":
            rows[(cells[1], int(cells[2]))] = cells
    assert set(rows) == {("off", 1), ("off", 2), ("on", 1), ("on", 2)}
    for (setting, _), cells in rows.items():
        tok_s, latency, forks, tokens = (float(cells[i]) for i in (3, 7, 10, 11))
        assert tok_s > 0 and latency > 0 and tokens == 8  # -n bounds each answer
        assert (forks > 0) == (setting == "on")
    assert rows[("off", 1)][4] == "1.00×" and re.fullmatch(r"\d+\.\d\d×", rows[("on", 2)][5])
