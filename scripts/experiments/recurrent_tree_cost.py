"""What a tree costs over recurrent layers: ms and kernels per step of chain and tree shapes on a
tiny random qwen3_5 (three Gated DeltaNet layers, one attention layer; mlx-lm's class), each
phase timed apart (``measure.profile.profile_steps``, as ``bench --profile`` does), with the
commit's share of the step, and the recurrent state the tree's path rows hold.

A tree's recurrent layers run its P root-to-leaf paths as batch rows (``lm_cache.path_layer``):
B * P rows of up to L tokens, each from the row's state repeated; the commit re-runs each
recurrent layer over the accepted path alone (P = L tokens a row), where a chain's commit
re-runs it over the C verified tokens.

    python -m scripts.experiments.recurrent_tree_cost [--out docs/bench/recurrent_trees.txt]
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.verifier.lm_model import from_config
from redrafter_mlx.measure.profile import profile_steps

QWEN3_5 = {
    "model_type": "qwen3_5",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 512,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 3,
    "rms_norm_eps": 1e-05,
    "head_dim": 64,
    "rope_theta": 1000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 1000,
}
SHAPES = ["W1xL3", "W2xL3", "W1xL4", "W4xL4"]


def paths_of(shape: BeamShape) -> int:
    """Candidates a step of ``shape`` verifies: the drafter's W beams and the beams its search
    dropped on the way (``frontier_tree``: W at each depth below the last), the paths."""
    return shape.width * (shape.length - 1) if shape.width > 1 else 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", help="write the table here too")
    args = ap.parse_args(argv)
    mx.random.seed(0)
    model = from_config(QWEN3_5, mx.float32)
    model.check_steps()
    H, V = model.hidden_size, model.vocab_size
    drafter = Drafter(DrafterArgs(vocab_size=V, hidden_size=H, exit_dim=2 * H, num_draft_layers=2))
    mx.eval(drafter.parameters())
    sources = held_sources(drafter)
    shapes = [BeamShape.parse(s) for s in args.shapes.split(",")]
    prompt = [(7 * i + 3) % V for i in range(64)]
    got = profile_steps(
        model, sources, shapes, prompt, repeats=args.repeats, loop_tokens=32, loop_rounds=2
    )
    state = sum(e.flat.shape[-1] for e in model.make_cache(1, 1)[1:]) * 4  # bytes a row
    lines = [
        f"tiny qwen3_5 (H={H}, 3 Gated DeltaNet + 1 attention layers), float32, "
        f"{got['device']}, prompt {len(prompt)}; verifies={model.verifies}",
        f"recurrent state {state} bytes a row (all layers); a tree's verify holds it per path",
        "",
        f"{'shape':<8} {'C':>3} {'paths':>5} {'step ms':>8} {'kernels':>7} {'verify ms':>9} "
        f"{'commit ms':>9} {'commit k':>8} {'commit %':>8}",
    ]
    for row in got["rows"]:
        name = row["config"]
        if name == "AR":
            lines.append(
                f"{'AR':<8} {1:>3} {1:>5} {row['step_ms']:>8.2f} {row['step_kernels']:>7} "
                f"{'':>9} {'':>9} {'':>8} {'':>8}"
            )
            continue
        shape = BeamShape.parse(name)
        share = 100 * row["commit_ms"] / row["step_ms"]
        lines.append(
            f"{name:<8} {row['capacity']:>3} {paths_of(shape):>5} {row['step_ms']:>8.2f} "
            f"{row['step_kernels']:>7} {row['verify_ms']:>9.2f} {row['commit_ms']:>9.2f} "
            f"{row['commit_kernels']:>8} {share:>7.1f}%"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
