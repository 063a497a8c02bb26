"""The family sweep's configs are tiny (mlx-lm's own test configs were not all: cohere's
named no sizes, so its class's defaults built 35e9 parameters and the sweep stalled there,
then ran out of memory), and the sweep runs each family in a worker process, so a family
that ends its process or hangs is a row naming it, not the end of the sweep."""

from __future__ import annotations

import math
import sys

from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.verifier.refusals import missing_package
from scripts.experiments.family_sweep import sweep
from tests.support.mlx_lm_sweep import CONFIGS, LIMIT


def test_every_sweep_config_builds_a_tiny_model():
    big = {}
    for name, config in CONFIGS.items():
        if missing_package(config["model_type"]):
            continue  # its module would end the process as it is imported
        cls, args = _get_classes(config)
        lm = cls(args.from_dict(config))  # lazy: nothing is computed
        size = sum(math.prod(v.shape) for _, v in tree_flatten(lm.parameters()))
        if size > LIMIT:
            big[name] = size
    assert not big, big


FAKE = """
import json, os, signal, sys, time
for name in sys.argv[1].split(","):
    if name.endswith("segv"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if name.endswith("exit"):
        print("To run it install a package", file=sys.stderr)
        sys.exit(1)
    if name.endswith("hang"):
        time.sleep(60)
    print(json.dumps(dict(family=name, status="ok", detail="", seconds=0.0)), flush=True)
"""


def test_a_family_that_crashes_or_hangs_its_worker_is_a_row_and_the_sweep_goes_on():
    names = ["a", "b_segv", "c", "d_exit", "e_hang", "f"]
    rows = sweep(
        set(names), timeout=3.0, command=lambda left: [sys.executable, "-c", FAKE, ",".join(left)]
    )
    got = {r.family: (r.status, r.detail) for r in rows}
    assert [r.family for r in rows] == names
    assert {n for n, (s, _) in got.items() if s == "ok"} == {"a", "c", "f"}
    assert got["b_segv"] == ("CRASH", "worker killed by SIGSEGV: ")
    assert got["d_exit"] == ("CRASH", "worker exit 1: To run it install a package")
    assert got["e_hang"][0] == "HANG"
