"""Tensor parallelism (engine/base/distributed.py): a model split across ranks decodes exactly as
the whole model does in one process.

The launched tests run ``mlx.launch -n N --backend ring`` on localhost
(tests/support/dist_worker.py is one rank) with tiny random models written to disk: tokens equal
the single-process engine's for plain decoding and ReDrafter at several shapes, with context
lookup, lookup alone, batch > 1, seeded sampling, biases, Gemma 2's soft caps and sliding
windows and a quantized model; the logits are bitwise the same on every rank; each rank holds
only its heads and about half the weights. Under ``-n 2`` the server's scheduler (rank 0 drives
it, rank 1 follows its events) answers concurrent greedy and sampled requests, one joining
mid-flight, with the single process's tokens; adaptive decoding makes the same switches on both
ranks, and the tuner's search decides alike; ``redrafter-mlx serve`` answers over HTTP and both
ranks exit 0 on SIGTERM. The rest runs in this process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.base.distributed import broadcast_text, shared_seed
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.loading import LoadError, load_drafter, load_model
from redrafter_mlx.engine.verifier import slots as model_module
from redrafter_mlx.engine.verifier.lm_model import from_config
from redrafter_mlx.engine.verifier.shard import ShardError, check_split
from redrafter_mlx.serve.scheduler import Scheduler
from tests.support.dist_worker import fresh_memory, serve_schedule
from tests.support.fakes import FakeGroup
from tests.support.models import (
    _randomize,
    run_decode,
    save_drafter_dir,
    save_model_dir,
    tiny_config,
    tiny_drafter,
    tiny_model,
)
from tests.support.paths import ROOT

LAUNCH = shutil.which("mlx.launch")
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="optional: mlx.launch not installed")

LLAMA = dict(  # 12 / 6 heads and 192 MLP rows split 2 or 3 ways; the layers outweigh the rest
    model_type="llama",
    hidden_size=48,
    num_hidden_layers=2,
    intermediate_size=192,
    num_attention_heads=12,
    num_key_value_heads=6,
    vocab_size=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
BIASED = dict(LLAMA, attention_bias=True, mlp_bias=True)  # o_proj / down_proj biases: once
GEMMA2 = dict(
    LLAMA,
    model_type="gemma2",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    sliding_window=4,
    tie_word_embeddings=True,
)
QUANT = dict(
    LLAMA, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)


def write_model(path: Path, config: dict, seed: int, quantize: bool = False) -> Path:
    """A random model folder (4-bit, groups of 32, with ``quantize``)."""
    model = from_config(tiny_config(**config))
    _randomize(model, seed, 2.0)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    save_model_dir(model, path)
    if quantize:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization"] = {"group_size": 32, "bits": 4}
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Model and drafter folders, by name."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    for name, config, quant in [
        ("llama", LLAMA, False),
        ("biased", BIASED, False),
        ("gemma2", GEMMA2, False),
        ("quant", QUANT, True),
    ]:
        out[name] = str(write_model(root / name, config, seed=len(out), quantize=quant))
        model, _ = load_model(out[name], mx.float32)
        save_drafter_dir(tiny_drafter(model, seed=10 + len(out)), root / f"{name}-drafter")
        out[f"{name}-drafter"] = str(root / f"{name}-drafter")
    for name, config in (("sliding", SLIDING), ("hybrid", HYBRID)):  # mlx-lm's ``shard``
        out[name] = str(write_mlx_lm_model(root / name, config))
        model, _ = load_model(out[name], mx.float32)
        save_drafter_dir(tiny_drafter(model, seed=10 + len(out)), root / f"{name}-drafter")
        out[f"{name}-drafter"] = str(root / f"{name}-drafter")
    return out


# Models that run as mlx-lm builds them (engine/verifier/lm_model.py), split by the family's own
# ``shard``: a Llama with sliding layers, and a Qwen3.5 hybrid (Gated DeltaNet + attention).
SLIDING = dict(
    LLAMA, num_hidden_layers=3, sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)  # fmt: skip
HYBRID = dict(
    model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=64, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=3, rms_norm_eps=1e-5, head_dim=16, rope_theta=1000.0,
    partial_rotary_factor=0.5, max_position_embeddings=1000, full_attention_interval=2,
)  # fmt: skip


def write_mlx_lm_model(path: Path, config: dict) -> Path:
    """A folder of mlx-lm's own class for ``config``, random weights."""
    from mlx_lm.utils import _get_classes

    cls, args = _get_classes(config)
    model = cls(args.from_dict(config))
    _randomize(model, 3, 2.0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


REPEAT = [1, 5, 9, 13, 17, 21, 5, 9, 13, 17, 21, 5, 9, 13]  # lookup finds continuations


def cases(folders: dict, n: int) -> dict:
    """name -> decode case for ``n`` ranks."""

    def case(model, shape, prompts, drafter=True, **kw):
        d = folders[f"{model}-drafter"] if drafter else None
        return dict(
            model=folders[model], drafter=d, shape=shape, prompts=prompts, max_tokens=12, **kw
        )

    two = [[1, 7, 3, 30, 2], [1, 4, 4, 8, 9, 10, 11, 12, 40]]
    out = {
        "ar": case("llama", "AR", two[:1], drafter=False),
        "beams_batch": case("llama", "W2xL3", two),
        "beams_lookup": case("llama", "W1xL4+K1xL8", [REPEAT]),
        "lookup_only": case("llama", "K1xL6", [REPEAT, two[1]], drafter=False),
        "sampled": case("llama", "W2xL3", two, temperature=0.8, seed=7),
        "unseeded": case("llama", "W2xL3", two, temperature=1.0),  # ranks agree on a seed
    }
    if n == 2:
        out |= {
            "biased": case("biased", "W2xL4", two),
            "gemma2": case("gemma2", "W2xL3+K1xL4", [REPEAT]),
            "quant": case("quant", "W1xL3", two),
            "fused": case("llama", "W2xL3+K1xL4", [REPEAT, two[1]], fused=True),  # Metal's path
            "sliding": case("sliding", "W2xL3+K1xL4", [REPEAT, two[1]]),
            "hybrid": case("hybrid", "W1xL3+K1xL4", [REPEAT, two[1]]),
        }
    return out


def single_process(case: dict) -> tuple[list, int, int]:
    """(tokens, parameter bytes, peak memory while loading) of the whole model here."""
    model_module.FUSED_KERNELS = case.get("fused")
    base = fresh_memory()
    model, _ = load_model(case["model"], mx.float32)
    peak = mx.get_peak_memory() - base
    drafter = load_drafter(case["drafter"], mx.float32) if case["drafter"] else None

    tokens, _ = run_decode(
        model,
        drafter,
        case["prompts"],
        max_tokens=case["max_tokens"],
        shape=BeamShape.parse(case["shape"]),
        adapt=False,
        seed=case.get("seed"),
        sampler=SamplerConfig(temperature=case.get("temperature", 0.0)),
    )
    model_module.FUSED_KERNELS = None
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return tokens, nbytes, peak


def launch(n: int, todo: dict, tmp_path: Path) -> list[dict]:
    """Run ``python -m tests.support.dist_worker`` on ``n`` local ranks; each rank's results."""
    (tmp_path / "cases.json").write_text(json.dumps(todo))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    cmd = [
        LAUNCH,
        "-n",
        str(n),
        "--backend",
        "ring",
        "--",
        sys.executable,
        "-m",  # as a module: run as a script, tests/support/ would come first on sys.path
        "tests.support.dist_worker",  # and its tuning.py would hide the tuning package
        str(tmp_path / "cases.json"),
        str(tmp_path),
    ]
    done = run_launched(cmd, env, 240)
    failed = done.returncode != 0 or "exited with code" in done.stderr  # a rank's failure
    assert not failed, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def run_launched(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``mlx.launch ...`` in its own session; on a timeout (ranks out of step wait
    forever) end the launcher and every rank it started, then fail."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launched ranks hung for {timeout} s: {err.decode()[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(), err.decode())


@needs_launch
@pytest.mark.parametrize("n", [2, 3])
def test_split_model_decodes_like_the_whole_one(n, folders, tmp_path):
    todo = cases(folders, n)
    ranks = launch(n, todo, tmp_path)
    for name, case in todo.items():
        tokens, nbytes, _peak = single_process(case)
        got = [r["cases"][name] for r in ranks]
        for r, res in enumerate(got):
            want = got[0]["tokens"] if name == "unseeded" else tokens  # a seed of its own
            assert res["tokens"] == want, f"{name}: rank {r} of {n} differs from one process"
        assert len({res["logits_sha"] for res in got}) == 1, f"{name}: logits differ by rank"
        heads = json.loads(Path(case["model"], "config.json").read_text())["num_key_value_heads"]
        assert all(res["kv_heads"] == heads // n for res in got)
        if name in ("ar", "quant"):  # each rank holds ~1/N of the layers' weights
            limit = 0.6 if n == 2 else 0.45
            assert max(res["param_bytes"] for res in got) <= limit * nbytes, name
            # Loading no longer reads only a rank's slices: mlx's shard_linear slices tensors
            # read whole (one at a time). Measured on this model: 437,765 bytes a rank against
            # 317,941 for the whole model (docs/design/any-model.md, "Tensor parallelism").


def test_heads_that_do_not_divide_name_the_counts_that_would():
    config = dict(
        LLAMA, num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=96
    )
    check_split(config, 3)
    with pytest.raises(ShardError, match=r"across 2 processes: launch 3 processes instead"):
        check_split(config, 2)
    with pytest.raises(ShardError, match="quantization groups of 32"):
        check_split(dict(LLAMA, quantization={"group_size": 32, "bits": 4}), 2)


def test_loading_refuses_an_unsplittable_model(folders):
    with pytest.raises(LoadError, match="across 5 processes: launch 2, 3 or 6"):
        load_model(folders["llama"], mx.float32, FakeGroup(5))


def test_launched_generate_refuses_a_prompt_from_stdin(monkeypatch):
    """mlx.launch forwards stdin but never its end: ``--prompt -`` would wait forever."""
    from redrafter_mlx.cli.common import FlagError
    from redrafter_mlx.cli.generate import shared_prompt
    from redrafter_mlx.engine.base import distributed

    monkeypatch.setattr(distributed, "world", lambda: FakeGroup(2, 1))
    with pytest.raises(FlagError, match="stdin never ends"):
        shared_prompt("-")
    assert shared_prompt("hello") == "hello"


def test_alone_nothing_is_sent():
    assert broadcast_text("hi", None) == "hi" and shared_seed(None, None) is None
    assert tiny_model().group is None


def cli(args: list[str], n: int = 1, stdin: str = "") -> str:
    """stdout of ``redrafter-mlx ARGS`` alone or on ``n`` launched ranks, which must succeed
    (mlx.launch exits 0 even when a rank fails: it says so on stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "redrafter_mlx.cli", *args]
    if n > 1:
        cmd = [LAUNCH, "-n", str(n), "--backend", "ring", "--", *cmd]
    done = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exited with code" not in done.stderr, done.stderr[-2000:]
    return done.stdout


@needs_launch
def test_generate_and_chat_print_once_from_rank_0():
    """``mlx.launch -n 2 redrafter-mlx generate|chat``: the single process's answer, once (the
    other rank is silent); chat lines typed to rank 0 reach both ranks."""
    gen = ["generate", "--model", "demo", "--prompt", "def is_even(n):", "--max-tokens", "24"]
    alone = json.loads(cli([*gen, "--json"]))
    both = json.loads(cli([*gen, "--json"], n=2))
    assert both["tokens"] == alone["tokens"] and both["text"] == alone["text"]
    chat = ["chat", "--model", "demo", "--max-tokens", "16", "--no-adapt"]
    lines = "Write is_even(n).\n/reset\nWrite is_odd(n).\n/quit\n"  # launched: no EOF
    answer = [line for line in cli(chat, stdin=lines).splitlines() if "tok/s" not in line]
    launched = [line for line in cli(chat, 2, lines).splitlines() if "tok/s" not in line]
    assert launched == answer


def test_bench_reports_what_a_split_step_sends(capsys):
    """``bench`` under mlx.launch adds the all_sum cost per step size; alone it adds nothing."""
    from types import SimpleNamespace

    from redrafter_mlx.cli.bench import split_cost
    from redrafter_mlx.cli.bench_render import print_split

    assert split_cost(SimpleNamespace(model=tiny_model()), []) is None
    row = dict(tokens=12, bytes=196608, floor_us=41.0, per_step_ms=9.6)
    print_split(dict(ranks=2, all_sums_per_step=160, sizes=[row]))
    out = capsys.readouterr().out
    assert "split across 2 ranks, 160 all_sums" in out and "T=12 (196,608 bytes): 41 µs" in out


def test_commands_that_cannot_split_refuse_to_launch(monkeypatch):
    """A command not written for ranks says so instead of hanging in a sum."""
    from redrafter_mlx.cli.common import prepare_engine
    from redrafter_mlx.engine.base import distributed

    monkeypatch.setattr(distributed, "world", lambda: FakeGroup(2))
    with pytest.raises(ValueError, match="does not run under mlx.launch yet"):
        prepare_engine("demo", None, None)


SERVED = [  # greedy of two lengths, seeded sampling with penalties and a bias, an unseeded
    # sample, and two requests that join mid-flight (4 rows: rows are freed and reused)
    dict(prompt=[1, 7, 3, 30, 2], n=14),
    dict(prompt=REPEAT, n=20),
    dict(
        prompt=[1, 4, 4, 8, 9, 10, 11, 12, 40],
        n=16,
        temperature=0.8,
        top_p=0.9,
        seed=11,
        repetition_penalty=1.2,
        logit_bias=[[5, 2.0]],
    ),
    dict(prompt=[2, 9, 9, 3], n=12, temperature=1.0),  # unseeded: rank 0 picks the seed
    dict(prompt=[1, 5, 9, 13], n=10, late=True),
    dict(prompt=[3, 3, 7], n=8, temperature=0.7, seed=3, late=True),
]


@needs_launch
def test_split_scheduler_and_adaptive_decoding_follow_rank_0(folders, tmp_path):
    """Under ``-n 2``: the server's scheduler, choosing each step's shape with step costs
    that differ by rank, runs rank 0's choices on both ranks and gives every request the
    single process's tokens on both (the unseeded sample: the same tokens on both);
    adaptive decoding, with step costs that differ by rank, runs rank 0's shapes on both
    ranks, switching, and
    gives the single process's greedy tokens; the tuner's search, with speeds that differ by
    rank, measures the same shapes on both and recommends rank 0's pick."""
    model, drafter = folders["llama"], folders["llama-drafter"]
    two = [[1, 7, 3, 30, 2], [1, 4, 4, 8, 9, 10, 11, 12, 40]]
    todo = {
        "serve": dict(model=model, drafter=drafter, shape="W2xL3+K1xL4", max_batch=4),
        "adapt": dict(model=model, drafter=drafter, shape="W2xL4", prompts=two, max_tokens=30),
        "lookup": dict(
            model=model, drafter=drafter, shape="W1xL3+K1xL4", prompts=[REPEAT], max_tokens=30
        ),
    }
    todo["serve"]["serve"], todo["adapt"]["adapt"] = SERVED, True
    todo["lookup"]["adapt"] = True  # per-step choice from match states: rank 0's, each step
    # Adaptive shapes, rank 0 choosing each step's for every rank (no seeded sample: one
    # pins the asked shape while it runs)
    unseeded = [spec for spec in SERVED if spec.get("seed") is None]
    todo["served_adapt"] = dict(todo["serve"], serve=unseeded, adapt=True)
    shapes = ["W1xL2", "W1xL3", "W1xL4"]
    todo["tune"] = dict(model=model, drafter=drafter, prompts=two[:1], shapes=shapes, tune=True)
    ranks = launch(2, todo, tmp_path)

    whole, _ = load_model(model, mx.float32)
    small = load_drafter(drafter, mx.float32)
    alone = serve_schedule(Scheduler(whole, small, BeamShape.parse("W2xL3+K1xL4"), (), 4), SERVED)
    got = [r["cases"]["serve"]["tokens"] for r in ranks]
    for i, spec in enumerate(SERVED):
        rid = f"r{i}"
        assert len(got[0][rid]) == spec["n"] + 1 and got[0][rid][-1] == "done", got[0][rid]
        assert got[1][rid] == got[0][rid], f"{rid}: rank 1's row differs from rank 0's"
        if spec.get("temperature") and spec.get("seed") is None:
            continue  # a seed of its own (the same on both ranks, checked above)
        assert got[0][rid] == alone[rid], f"{rid}: the split server differs from one process"
    got = [r["cases"]["served_adapt"]["tokens"] for r in ranks]
    assert got[0] == got[1], "rank 1's rows differ from rank 0's"
    for i, spec in enumerate(unseeded):
        if not spec.get("temperature"):
            assert got[0][f"r{i}"] == alone[f"r{SERVED.index(spec)}"]
    served = [r["cases"]["served_adapt"]["shapes"] for r in ranks]
    assert served[0] == served[1] and len(served[0]) > 1, served  # switched, together

    want, _ = run_decode(whole, small, two, max_tokens=30, shape=BeamShape.parse("W2xL4"))
    runs = [r["cases"]["adapt"] for r in ranks]
    assert all(run["tokens"] == want for run in runs)
    assert runs[0]["shapes"] == runs[1]["shapes"], "the ranks ran different shapes"
    assert len(set(runs[0]["shapes"])) > 1, "no switch: the check would be empty"
    # rank 0's costs settle on a short beam; rank 1's own would have gone back to AR
    assert "AR" not in runs[1]["shapes"][-8:], runs[1]["shapes"]
    want, _ = run_decode(whole, None, [REPEAT], max_tokens=30)
    runs = [r["cases"]["lookup"] for r in ranks]
    assert all(run["tokens"] == want for run in runs)
    assert runs[0]["shapes"] == runs[1]["shapes"] and len(set(runs[0]["shapes"])) > 1

    # tune: both ranks measured the same shapes in the same order and recommend what rank
    # 0's speeds say (rank 1's own would say plain decoding)
    tuned = [r["cases"]["tune"] for r in ranks]
    assert tuned[0]["measured"] == tuned[1]["measured"] and len(tuned[0]["measured"]) > 4
    assert tuned[0]["recommended"] == tuned[1]["recommended"] == "W1×L4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process of ``rank`` started by the ``mlx.launch`` process ``launcher`` (Linux)."""

    def parent(pid: str) -> str:
        status = Path("/proc", pid, "status").read_text()
        return next(line.split()[1] for line in status.splitlines() if line.startswith("PPid"))

    for proc in Path("/proc").iterdir():
        try:
            if f"MLX_RANK={rank}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            pid = proc.name
            while pid not in ("0", "1", str(launcher)):
                pid = parent(pid)
            if pid == str(launcher):
                return int(proc.name)
        except (OSError, StopIteration):
            continue
    return None


@needs_launch
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks in /proc")
def test_launched_serve_answers_over_http_and_stops_on_sigterm():
    """``mlx.launch -n 2 redrafter-mlx serve``: rank 0 answers two concurrent greedy requests
    with the single process's text; SIGTERM to rank 0 stops it and rank 1 with it, both
    exiting 0."""
    import httpx

    import redrafter_mlx
    from redrafter_mlx.engine.base.bundled import demo_paths

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    serve = [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--model", "demo"]
    serve += ["--port", str(port), "--max-batch", "2", "--shutdown-grace", "1"]
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--", *serve]
    launched = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    asks = [("def fibonacci(n):", 24), ("import os\n\n\ndef walk(path):", 16)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert launched.poll() is None, launched.communicate()[1].decode()[-2000:]
            assert time.time() < deadline, "the launched server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        answers = {}

        def ask(prompt, n):
            body = dict(model="demo", prompt=prompt, max_tokens=n, temperature=0)
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            answers[prompt] = reply.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=a) for a in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rank0 = rank_pid(launched.pid, 0)
        assert rank0 is not None
        os.kill(rank0, signal.SIGTERM)
        _, err = launched.communicate(timeout=60)
    finally:
        if launched.poll() is None:  # a hang: end what this test started
            os.killpg(launched.pid, signal.SIGKILL)
            launched.communicate()
    err = err.decode()
    assert launched.returncode == 0 and "exited with code" not in err, err[-2000:]
    assert "was killed" not in err, err[-2000:]
    model, drafter, tok = redrafter_mlx.load(*demo_paths())
    for prompt, n in asks:
        want = redrafter_mlx.generate(model, drafter, tok, tok.encode(prompt), max_tokens=n)
        assert answers[prompt] == want, prompt


def test_a_follower_applies_rank_0s_events_until_stop(folders, monkeypatch):
    """``Scheduler.follow`` on a rank other than 0, rank 0's messages played in: it admits
    the request, gives it the tokens one process gives it, and returns at the stop event; a
    message whose count of batch faults differs from its own ends it with an error."""
    from redrafter_mlx.serve import requests as requests_module
    from redrafter_mlx.serve import scheduler as scheduler_module
    from redrafter_mlx.serve.scheduler import STOP, Request, admit_event
    from tests.support.dist_worker import collect

    model, _ = load_model(folders["llama"], mx.float32)
    shape = BeamShape.parse("W2xL3")
    drafter = load_drafter(folders["llama-drafter"], mx.float32)
    spec = dict(prompt=[1, 7, 3, 30, 2], n=9, temperature=0.8, seed=4)
    alone = serve_schedule(Scheduler(model, drafter, shape, (), 2), [spec])["r0"]

    got: list = []
    sampler = SamplerConfig(temperature=0.8, seed=4)
    request = Request([1, 7, 3, 30, 2], 9, lambda ev: None, sampler, id="r0")
    sent = [[admit_event(request, 4, 0)]]

    def rank0(raw, group):  # what rank 0 would send: the admission, nothing, then stop
        events = sent.pop() if sent else ([STOP] if got and got[-1] == "done" else [])
        return json.dumps({"events": events, "faults": 0, "nap": 0.0}).encode()

    def recording(event, original=scheduler_module.request_from):
        copy = original(event)
        copy.sink = collect(got)
        return copy

    monkeypatch.setattr(requests_module, "broadcast_bytes", rank0)
    monkeypatch.setattr(scheduler_module, "request_from", recording)
    Scheduler(model, drafter, shape, (), 2, group=FakeGroup(2, 1)).follow()
    assert got == alone and len(got) == 10

    out_of_step = json.dumps({"events": [], "faults": 1, "nap": 0.0}).encode()
    monkeypatch.setattr(requests_module, "broadcast_bytes", lambda raw, group: out_of_step)
    with pytest.raises(RuntimeError, match="out of step with rank 0"):
        Scheduler(model, drafter, shape, (), 2, group=FakeGroup(2, 1)).follow()
