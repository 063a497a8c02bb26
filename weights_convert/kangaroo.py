"""Kangaroo early-exit adapter checkpoints (Equationliu/Kangaroo) -> our adapter folder.

Source layout (the public code's ``AdapterModel``, read for us from the repository; its
checkpoints are ``config.json`` + ``pytorch_model.bin`` saved with ``torch.save``):

    config.json    a transformers LlamaConfig: the base model's, num_hidden_layers = the
                   adapter's layers (1 for the published Vicuna adapters)
    norm.weight                                   (H,)
    layers.{i}.input_layernorm.weight             (H,)
    layers.{i}.self_attn.q_proj.weight            (n_heads * D, H)
    layers.{i}.self_attn.{k,v}_proj.weight        (n_kv * D, H)
    layers.{i}.self_attn.o_proj.weight            (H, n_heads * D)
    layers.{i}.self_attn.rotary_emb.inv_freq      a buffer: dropped

No bias, no MLP; the forward is ``h = h + attn(input_layernorm(h))`` per layer, then
``norm(h)``, the base model's LM head on top (not stored here). The exit layer is not in the
checkpoint (the public code takes ``--exitlayer``, 2 for Vicuna-7B): ``exit_layer`` comes
from the caller or a config key ``exit_layer``. The code loads with ``strict=False``, so a
checkpoint may carry tensors the forward never reads: a decoder layer's
``post_attention_layernorm`` / ``mlp.*`` and a copy of the head or embedding are dropped
(listed), any other name is refused. A ``model.`` prefix (a wrapped module) is removed.

Output: the engine's early-exit folder (``engine/drafting/early_exit.py``): ``config.json`` with
``"kind": "early-exit"`` and the names above, unchanged.
"""

from __future__ import annotations

import re

from redrafter_mlx.engine.drafting.early_exit import EarlyExitArgs, check_exit_layer
from weights_convert.drafter import DrafterPlan, complete, keep
from weights_convert.errors import ConversionError
from weights_convert.tensors import TensorRef

PUBLIC_EXIT_LAYER = 2  # the public Vicuna-7B adapter's (its README: --exitlayer 2)
_UNUSED = re.compile(
    r"^(layers\.\d+\.(post_attention_layernorm\.weight|mlp\..+|self_attn\.rotary_emb\.inv_freq)"
    r"|lm_head\.weight|embed_tokens\.weight)$"
)
_MARKER = "layers.0.self_attn.q_proj.weight"


def _name(name: str) -> str:
    return name.removeprefix("model.")


def is_kangaroo(refs: list[TensorRef]) -> bool:
    """Whether a checkpoint's tensors are a Kangaroo adapter's (attention layers and a final
    norm, no embedding table of a full model)."""
    names = {_name(r.name) for r in refs}
    return _MARKER in names and "norm.weight" in names and "embed_tokens.weight" not in names


def missing_norm(refs: list[TensorRef]) -> str | None:
    """The final norm's name when a checkpoint has a Kangaroo adapter's attention tensors
    (and no embedding table) but lacks that norm: an incomplete adapter, not another kind."""
    names = {_name(r.name) for r in refs}
    if _MARKER in names and "embed_tokens.weight" not in names and "norm.weight" not in names:
        return "norm.weight"
    return None


def adapter_args(config: dict, base_config: dict, root, exit_layer: int | None) -> EarlyExitArgs:
    """The adapter's ``EarlyExitArgs`` from its LlamaConfig, checked against the base model."""
    for key in ("hidden_size", "num_attention_heads"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise ConversionError(f"adapter config {root}/config.json lacks a valid {key}")
    if config["hidden_size"] != base_config["hidden_size"]:
        raise ConversionError(
            f"adapter/LLM mismatch: the adapter's hidden_size is {config['hidden_size']} but the "
            f"base model's is {base_config['hidden_size']}; use the adapter trained for this model"
        )
    exit_layer = exit_layer if exit_layer is not None else config.get("exit_layer")
    if exit_layer is None:
        raise ConversionError(
            f"{root} does not record its exit layer: pass --exit-layer (the public Vicuna-7B "
            f"adapter's is {PUBLIC_EXIT_LAYER}, the 13B's 3)"
        )
    try:
        check_exit_layer(exit_layer, base_config["num_hidden_layers"])
    except ValueError as e:
        raise ConversionError(str(e)) from None
    heads = config["num_attention_heads"]
    rope = config.get("rope_scaling")
    return EarlyExitArgs(
        exit_layer=exit_layer,
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=base_config["vocab_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0),
        rope_scaling=rope if isinstance(rope, dict) else None,
        num_layers=config.get("num_hidden_layers", 1),
    )


def expected_shapes(args: EarlyExitArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the adapter's config implies -> its shape."""
    H, q, kv = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    D = args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"norm.weight": (H,)}
    for i in range(args.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (q * D, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv * D, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv * D, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, q * D)
    return shapes


def plan_tensors(refs: list[TensorRef], args: EarlyExitArgs, root) -> DrafterPlan:
    """Keep the adapter's tensors (names unchanged), drop the unused, refuse the rest."""
    shapes = expected_shapes(args)
    kept, dropped = [], []
    for ref in refs:
        name = _name(ref.name)
        if name not in shapes:
            if _UNUSED.match(name):
                dropped.append(ref.name)
                continue
            raise ConversionError(
                f"adapter tensor {ref.name} in {ref.path.name} is not part of a Kangaroo adapter "
                f"with {args.num_layers} layer(s); check {root}/config.json (num_hidden_layers)"
            )
        keep(kept, "adapter", name, ref, shapes, root)
    return complete(kept, dropped, "adapter", shapes, root)


def output_config(args: EarlyExitArgs, dtype: str) -> dict:
    """The converted adapter's config.json (``EarlyExitArgs.to_config`` + the storage dtype)."""
    return {**args.to_config(), "torch_dtype": dtype, "source": "kangaroo"}
