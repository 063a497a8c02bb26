"""Benchmark the converter on a synthetic multi-shard fp16 PyTorch checkpoint (no torch needed).

    python -m scripts.bench_convert --size-gb 2 --shards 3 [--quantize] [--keep]

Writes a Llama-shaped checkpoint of about ``--size-gb`` GB as ``pytorch_model-0000i-of-0000N.bin``
zip shards (torch's layout, written here byte by byte) plus its index, converts it in a
subprocess (so the writer's memory does not count), and reports throughput (source MB/s) and
the converting process's peak RSS, also divided by the largest shard's size (target ≤ 2.5).
The synthetic files are deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, VOCAB, HEADS = 2048, 5504, 32000, 16


def _tensor_shapes(n_layers: int) -> dict[str, tuple[int, int] | tuple[int]]:
    """HF Llama tensor names -> shapes for a model with ``n_layers`` layers."""
    h, i = HIDDEN, INTERMEDIATE
    shapes: dict = {"model.embed_tokens.weight": (VOCAB, h)}
    for layer in range(n_layers):
        p = f"model.layers.{layer}"
        for proj in ("q", "k", "v", "o"):
            shapes[f"{p}.self_attn.{proj}_proj.weight"] = (h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (VOCAB, h)
    return shapes


def _layers_for(size_gb: float) -> int:
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE) * 2
    return max(1, round((size_gb * 1e9 - 2 * VOCAB * HIDDEN * 2) / per_layer))


def _config(n_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_hidden_layers": n_layers,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }


# --- torch's pickle layout, protocol 2 opcodes ---------------------------------------------------


def _op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _op_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _op_int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def _op_tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _state_dict_pickle(shapes: dict[str, tuple[int, ...]]) -> bytes:
    """``OrderedDict(name -> _rebuild_tensor_v2(HalfStorage key=i, 0, shape, stride))``."""
    ordered_dict = _op_global("collections", "OrderedDict") + b")R"
    body = b""
    for key, (name, shape) in enumerate(shapes.items()):
        numel = int(np.prod(shape))
        stride = [int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
        pid = (
            _op_tuple(
                [
                    _op_str("storage"),
                    _op_global("torch", "HalfStorage"),
                    _op_str(str(key)),
                    _op_str("cpu"),
                    _op_int(numel),
                ]
            )
            + b"Q"
        )
        args = _op_tuple(
            [
                pid,
                _op_int(0),
                _op_tuple([_op_int(s) for s in shape]),
                _op_tuple([_op_int(s) for s in stride]),
                b"\x89",
                ordered_dict,
            ]
        )
        body += _op_str(name) + _op_global("torch._utils", "_rebuild_tensor_v2") + args + b"R"
    return b"\x80\x02" + ordered_dict + b"(" + body + b"u."


def _write_bin_shard(
    path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator
) -> None:
    """One fp16 shard in torch's zip layout, streamed tensor by tensor (bounded memory)."""
    block = (rng.standard_normal(1 << 20) * 0.02).astype(np.float16)  # 2 MB of values, reused
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr("archive/data.pkl", _state_dict_pickle(shapes))
        zf.writestr("archive/byteorder", "little")
        for key, shape in enumerate(shapes.values()):
            remaining = int(np.prod(shape))
            with zf.open(f"archive/data/{key}", "w", force_zip64=True) as f:
                while remaining:
                    n = min(remaining, block.size)
                    f.write(np.roll(block, remaining % 997)[:n].tobytes())
                    remaining -= n
        zf.writestr("archive/version", "3\n")


def write_checkpoint(folder: Path, size_gb: float, shards: int) -> dict:
    """Write config.json, ``shards`` .bin shards and the index -> facts about the checkpoint."""
    folder.mkdir(parents=True)
    n_layers = _layers_for(size_gb)
    shapes = _tensor_shapes(n_layers)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    groups: list[dict] = [{} for _ in range(shards)]
    running = 0
    for name, shape in shapes.items():
        groups[min(shards - 1, running * shards // total)][name] = shape
        running += int(np.prod(shape)) * 2
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file_name = f"pytorch_model-{i:05d}-of-{shards:05d}.bin"
        _write_bin_shard(folder / file_name, group, rng)
        weight_map.update({name: file_name for name in group})
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(_config(n_layers)))
    sizes = [(folder / f).stat().st_size for f in sorted(set(weight_map.values()))]
    return {"layers": n_layers, "bytes": total, "largest_shard": max(sizes), "shards": len(sizes)}


def _child(src: str, out: str, quantize: bool) -> None:
    """Run in the subprocess: convert, then print JSON with seconds and peak RSS (bytes)."""
    from weights_convert import convert

    start = time.perf_counter()
    summary = convert(src, out, quantize=quantize, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024
    )
    print(
        json.dumps({"seconds": seconds, "peak_rss": peak, "bytes_on_disk": summary.bytes_on_disk})
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--quantize", action="store_true", help="also time a 4-bit conversion")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to write (default: a temp folder)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the synthetic files")
    parser.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--child-quantize", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child, quantize=args.child_quantize)
        return

    work = Path(tempfile.mkdtemp(prefix="bench_convert-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        facts = write_checkpoint(work / "src", args.size_gb, args.shards)
        print(
            f"synthetic checkpoint: {facts['bytes'] / 1e9:.2f} GB fp16, {facts['layers']} layers, "
            f"{facts['shards']} .bin shards (largest {facts['largest_shard'] / 1e6:.0f} MB), "
            f"written in {time.perf_counter() - t0:.1f} s"
        )
        runs = [("fp16", False)] + ([("4-bit", True)] if args.quantize else [])
        for label, quantize in runs:
            out = work / f"out-{label}"
            cmd = [
                sys.executable,
                "-m",
                "scripts.bench_convert",
                "--child",
                str(work / "src"),
                str(out),
            ]
            result = subprocess.run(
                cmd + (["--child-quantize"] if quantize else []),
                capture_output=True,
                text=True,
                check=True,
            )
            stats = json.loads(result.stdout.strip().splitlines()[-1])
            mb_s = facts["bytes"] / 1e6 / stats["seconds"]
            ratio = stats["peak_rss"] / facts["largest_shard"]
            print(
                f"{label:>5}: {stats['seconds']:.1f} s, {mb_s:.0f} MB/s, "
                f"peak RSS {stats['peak_rss'] / 1e6:.0f} MB "
                f"= {ratio:.2f} x largest shard (target <= 2.5), "
                f"output {stats['bytes_on_disk'] / 1e9:.2f} GB"
            )
            shutil.rmtree(out)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
