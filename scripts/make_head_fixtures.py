"""Write the golden fixtures of ``tests/test_heads_formats.py`` from the reference
implementation, mlx-vlm 0.7.10's drafter classes (``pip install --no-deps mlx-vlm==0.7.10``
plus Pillow and transformers: ``pip install -e '.[heads-ref]'``).

Each fixture under ``tests/fixtures/heads/<name>/`` is a tiny head written with its
published config keys and tensor names (random weights, float32): ``config.json``,
``model.safetensors``, and ``case.npz``: the target's embedding and head (``target_embed``
(V, H), ``target_head`` (V, H)), the inputs of two draft rounds (a prompt's features, the
bonus token; the verify features, an accepted count, the next bonus) and the reference's
drafts and logits of each round (``drafts1``/``logits1``, ``drafts2``/``logits2``).

Run: ``python scripts/make_head_fixtures.py`` (a few seconds); commit the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "heads"
H, V, P, ACCEPTED = 32, 128, 6, 1  # hidden, target vocabulary, prompt, accepted in round 1


class TargetStub(nn.Module):
    """The target's embedding and head, as the reference's ``bind`` finds them."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)


def randomize(module: nn.Module, key: int) -> None:
    """Every float parameter random (norm weights near 1), so a wrong name or order shows."""
    mx.random.seed(key)
    params = []
    for name, p in tree_flatten(module.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            params.append((name, p))
        elif p.ndim == 1:
            params.append((name, 1.0 + 0.2 * mx.random.normal(p.shape)))
        else:
            params.append((name, 0.3 * mx.random.normal(p.shape)))
    module.update(tree_unflatten(params))
    mx.eval(module.parameters())


class Recorder:
    """Wraps a logits function; keeps each call's output."""

    def __init__(self, fn):
        self.fn, self.out = fn, []

    def __call__(self, x):
        y = self.fn(x)
        self.out.append(y)
        return y

    def take(self) -> np.ndarray:
        out = np.concatenate([np.array(y.astype(mx.float32)) for y in self.out], axis=1)
        self.out = []
        return out


def greedy(logits):
    return mx.argmax(logits, axis=-1)


def write(name: str, config: dict, weights: dict, target: TargetStub, case: dict) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    case = {k: np.array(v) for k, v in case.items()}
    case["target_embed"] = np.array(target.embed_tokens.weight)
    case["target_head"] = np.array(target.lm_head.weight)
    np.savez_compressed(folder / "case.npz", **case)
    print(f"{folder}: {sum(f.stat().st_size for f in folder.iterdir()) // 1024} KB")


def inputs(key: int, width: int, depth: int):
    mx.random.seed(key)
    ids = mx.random.randint(0, V, (1, P)).astype(mx.int32)
    hidden = mx.random.normal((1, P, width))
    verify = mx.random.normal((1, depth + 1, width))
    bonus, bonus2 = 7, 11
    return ids, hidden, verify, bonus, bonus2


def eagle3() -> None:
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "vocab_size": V,
        "max_position_embeddings": 2048,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": 64,
        "target_hidden_size": H,
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": [2, 3, 5],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]},
        },
    }
    ref = Eagle3DraftModel(Eagle3Config.from_dict(config))
    randomize(ref, 1)
    mx.random.seed(2)
    t_ids = mx.sort(mx.random.permutation(V)[:64]).astype(mx.int32)
    d2t = t_ids - mx.arange(64, dtype=mx.int32)
    ref.d2t = d2t
    weights = dict(tree_flatten(ref.parameters()))
    weights["d2t"] = d2t.astype(mx.int64)
    weights["t2d"] = mx.array(np.isin(np.arange(V), np.array(t_ids)))
    target = TargetStub()
    randomize(target, 3)
    depth = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    block = depth + 1  # the reference's block: the init token and the drafts
    ids, hidden, verify, bonus, bonus2 = inputs(4, 3 * H, depth)

    ref.reset(target)
    rec = Recorder(ref._logits)
    ref._logits = rec
    ref.prefill_from_target_hidden(ids, hidden, bonus, greedy, greedy=True)
    drafts1 = ref.draft_block(bonus, hidden, None, block, greedy, greedy=True)
    logits1 = rec.take()
    ref.accept_verified_tokens(verify, drafts1, ACCEPTED, [bonus2], greedy, greedy=True)
    drafts2 = ref.draft_block(bonus2, verify, None, block, greedy, greedy=True)
    logits2 = rec.take()
    case = dict(
        ids=ids,
        hidden=hidden,
        verify=verify,
        bonus=bonus,
        bonus2=bonus2,
        accepted=ACCEPTED,
        depth=depth,
        drafts1=drafts1,
        logits1=logits1,
        drafts2=drafts2,
        logits2=logits2,
    )
    write("eagle3", config, weights, target, case)

    original = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **{k: v for k, v in layer.items() if k != "architectures"},
        "draft_vocab_size": 64,
    }
    original["model_type"] = "llama"
    renamed = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in weights.items()
    }
    # the original layout's residual is the un-normed feature: its own reference run
    ref_o = Eagle3DraftModel(
        Eagle3Config.from_dict(
            {
                "speculators_model_type": "eagle3",
                "transformer_layer_config": layer,
                "draft_vocab_size": 64,
                "norm_before_residual": False,
            }
        )
    )
    ref_o.update(ref.parameters())
    ref_o.d2t = d2t
    ref_o.reset(target)
    rec = Recorder(ref_o._logits)
    ref_o._logits = rec
    ref_o.prefill_from_target_hidden(ids, hidden, bonus, greedy, greedy=True)
    o1 = ref_o.draft_block(bonus, hidden, None, block, greedy, greedy=True)
    l1 = rec.take()
    ref_o.accept_verified_tokens(verify, o1, ACCEPTED, [bonus2], greedy, greedy=True)
    o2 = ref_o.draft_block(bonus2, verify, None, block, greedy, greedy=True)
    l2 = rec.take()
    case.update(drafts1=o1, logits1=l1, drafts2=o2, logits2=l2)
    write("eagle3_original", original, renamed, target, case)


def block() -> None:
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "block_size": 4,
        "num_target_layers": 4,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [0, 3]},
    }
    ref = DFlashDraftModel(ModelConfig.from_dict(config))
    randomize(ref, 5)
    weights = {
        "model." + k if k.startswith("layers.") else k: v for k, v in tree_flatten(ref.parameters())
    }
    target = TargetStub()
    randomize(target, 6)
    size = config["block_size"]
    ids, hidden, verify, bonus, bonus2 = inputs(7, 2 * H, size - 1)
    cache = ref.reset(target)
    rec = Recorder(ref._logits)
    ref._logits = rec
    drafts1 = ref.draft_block(bonus, hidden, cache, size, greedy)
    logits1 = rec.take()
    committed = verify[:, : ACCEPTED + 1]
    drafts2 = ref.draft_block(bonus2, committed, cache, size, greedy)
    logits2 = rec.take()
    case = dict(
        ids=ids,
        hidden=hidden,
        verify=verify,
        bonus=bonus,
        bonus2=bonus2,
        accepted=ACCEPTED,
        depth=size - 1,
        drafts1=drafts1,
        logits1=logits1,
        drafts2=drafts2,
        logits2=logits2,
    )
    write("dflash", config, weights, target, case)


def mtp() -> None:
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model, ModelConfig

    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "max_position_embeddings": 4096,
        "full_attention_interval": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    }
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
    }
    ref = Model(ModelConfig.from_dict({"model_type": "qwen3_5_mtp", "text_config": text}))
    randomize(ref, 8)
    target = TargetStub()
    randomize(target, 9)
    norms = (
        "layernorm.weight",
        "q_norm.weight",
        "k_norm.weight",
        "norm.weight",
        "pre_fc_norm_embedding.weight",
        "pre_fc_norm_hidden.weight",
    )
    weights = {}
    for k, v in tree_flatten(ref.parameters()):  # HF layout: zero-centred norms, mtp.*
        weights["mtp." + k] = v - 1.0 if k.endswith(norms) and v.ndim == 1 else v
    weights["model.language_model.embed_tokens.weight"] = target.embed_tokens.weight
    weights["lm_head.weight"] = target.lm_head.weight
    ref.load_weights(
        list(ref.sanitize({k: v for k, v in weights.items() if k.startswith("mtp.")}).items())
    )
    depth = text["mtp_num_hidden_layers"] + 1  # the reference's block_size - 1
    block = depth + 1
    ids, hidden, verify, bonus, bonus2 = inputs(10, H, depth)
    ref.reset(target)
    rec = Recorder(ref._lm_head_fn)
    ref._lm_head_fn = rec
    ref.prefill_from_target_hidden(ids, hidden, bonus, greedy, greedy=True)
    drafts1 = ref.draft_block(bonus, hidden, None, block, greedy, greedy=True)
    logits1 = rec.take()
    ref.accept_verified_tokens(verify, drafts1, ACCEPTED, [bonus2], greedy, greedy=True)
    drafts2 = ref.draft_block(bonus2, verify, None, block, greedy, greedy=True)
    logits2 = rec.take()
    case = dict(
        ids=ids,
        hidden=hidden,
        verify=verify,
        bonus=bonus,
        bonus2=bonus2,
        accepted=ACCEPTED,
        depth=depth,
        drafts1=drafts1,
        logits1=logits1,
        drafts2=drafts2,
        logits2=logits2,
    )
    write("qwen3_5_mtp", config, weights, target, case)


BUILDERS = {"eagle3": eagle3, "dflash": block, "qwen3_5_mtp": mtp}

if __name__ == "__main__":
    for name in sys.argv[1:] or BUILDERS:
        BUILDERS[name]()
