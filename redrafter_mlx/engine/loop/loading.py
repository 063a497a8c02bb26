"""Load an mlx-lm model directory (the verifier) and a ReDrafter drafter directory.

Model directory: ``config.json`` (+ optional ``quantization`` block), ``model.safetensors``
or ``model-*.safetensors`` shards with ``model.safetensors.index.json``, tokenizer files.
Drafter directory: ``config.json`` + ``model.safetensors`` with the reference names.
A Hugging Face repo id is resolved through the local Hugging Face cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..base.platform import default_dtype
from ..core.branches import split_token_ids
from ..drafting import early_exit, kinds
from ..drafting.draft_model import MAX_ADDED_TOKENS, check_draft_model
from ..drafting.drafter import Drafter, DrafterArgs
from ..drafting.early_exit import is_early_exit, kind_problem
from ..drafting.head_sources import head_source
from ..drafting.held import held_sources
from ..verifier import config as config_file
from ..verifier.lm_checks import check_compiles, check_parity
from ..verifier.lm_model import LmModel
from ..verifier.protocol import Verifier
from ..verifier.refusals import check_family as refused_by_name
from ..verifier.shard import check_split
from ..verifier.weight_files import (
    LoadError,
    head_copies,
    load_checked,
    non_finite,
    tensor_names,
    weight_files_of,
)
from .folder_checks import check_finite, has_tokenizer, read_tokenizer


def resolve_path(path_or_repo: str | os.PathLike, what: str = "model") -> Path:
    """A local directory, or a Hugging Face repo id found in (or fetched into) the HF cache."""
    from ..base.hub import ResolveError, resolve

    try:
        return resolve(path_or_repo, what)
    except ResolveError as e:
        raise LoadError(str(e)) from None


def read_config(path: Path, what: str = "model") -> dict:
    """config.json as a dict, or LoadError (the shared validator's message)."""
    try:
        return config_file.read_config(path, what)
    except config_file.ConfigError as e:
        raise LoadError(str(e)) from None


def _apply_weights(module: nn.Module, weights: dict, config: dict, dtype, where: Path):
    """Quantize layers that carry scales, cast float weights to ``dtype``, load strictly."""
    quant = config.get("quantization") or config.get("quantization_config")
    if quant:
        nn.quantize(
            module,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=lambda p, m: (  # mlx-lm's per-layer overrides (e.g. an 8-bit embedding)
                quant[p] if isinstance(quant.get(p), dict) else f"{p}.scales" in weights
            ),
        )
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"weights in {where} do not match its config.json: {e}") from None
    materialize(module)  # once at load time: weights are resident before timing


def materialize(*modules) -> None:
    """Evaluate every array the modules hold, parameters or not (e.g. RoPE frequencies).

    Weights are resident before anything is timed, and a lazy array is no longer tied to the
    thread that built it (MLX raises "There is no Stream(cpu, 0) in current thread" when another
    thread, such as the server's engine loop, evaluates it).
    """
    arrays = []
    for module in modules:
        if module is None:
            continue
        for _, sub in module.named_modules():
            held = [*vars(sub).values(), *sub.values()]  # attributes and module entries
            arrays += [v for v in held if isinstance(v, mx.array)]
    mx.eval(arrays)


def load_model(path: str | os.PathLike, dtype=None, group=None) -> tuple[Verifier, Path]:
    """The verifier in ``dtype`` as mlx-lm builds it (``engine.verifier.lm_model``): its
    family class, its ``sanitize`` and quantization rules, float weights in ``dtype`` (where
    the family keeps some in float32, they stay). With an ``mx.distributed`` ``group`` of
    N > 1 ranks, this rank's 1/N of it (the family's ``shard``, or ``shard.llama_like``).
    A ``model_type`` mlx-lm does not know, or a config or weights mlx-lm refuses: LoadError
    naming mlx-lm's version and reason."""
    path = resolve_path(path)
    config = read_config(path)
    dtype = dtype or default_dtype()
    import mlx_lm
    from mlx_lm.utils import _get_classes
    from mlx_lm.utils import load_model as mlx_lm_load

    version = mlx_lm.__version__
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise LoadError(f"{path}/config.json has no model_type; re-download the config")
    try:
        refused_by_name(model_type)  # before mlx-lm imports, builds or runs it
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None
    try:
        _get_classes(config)
    except ValueError:
        raise LoadError(
            f"{path}: model_type {model_type!r} is not one mlx-lm {version} implements; "
            "upgrade mlx-lm (pip install -U mlx-lm) for newer families"
        ) from None
    try:
        config_file.check_family(config, path / "config.json")
    except config_file.ConfigError as e:
        raise LoadError(str(e)) from None
    files = weight_files_of(path)
    names = tensor_names(files)  # every file's header, read and checked once
    try:
        built = config_file.for_mlx_lm(
            config, names, path / "config.json", lambda: head_copies(files)
        )
    except config_file.ConfigError as e:
        raise LoadError(str(e)) from None
    tied = built.get(config_file.TIE_KEY) and model_type in config_file.FAMILY_DEFAULTS
    copies = {n for n, _ in config_file.head_pairs(names)} if tied else set()
    try:
        lm, _ = mlx_lm_load(
            path, lazy=True, strict=True, model_config=built, get_model_classes=dropping(copies)
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"{path}: mlx-lm {version} cannot build this {model_type} model: {reason}"
        ) from None
    keep = getattr(lm, "cast_predicate", None)
    cast = [
        (name, value.astype(dtype))
        for name, value in tree_flatten(lm.parameters())
        if mx.issubdtype(value.dtype, mx.floating) and (keep is None or keep(name))
    ]
    lm.load_weights(cast, strict=False)
    if group is not None:
        split(lm, built, group, path)
        for _, value in tree_flatten(lm.parameters()):  # one tensor read at a time: a rank
            mx.eval(value)  # holds its slices, never the whole model
    materialize(lm)
    check_finite(lm, files, path)  # NaN or infinity: named (tensor, file), never decoded
    try:
        model = LmModel(lm, built)
        check_parity(model)  # the engine's caches give mlx-lm's own logits
        model.check_commit()
        model.check_steps()  # what a step may verify: a tree, a chain, or one token
        check_compiles(model)  # the step is compiled: no host read in the family's forward
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None
    if group is not None:
        model.group, model.shards = group, group.size()
    model.split_ids = split_token_ids(path)  # an APAR model's: never drawn without branches
    model.eval()
    return model, path


def dropping(names: set):
    """mlx-lm's ``get_model_classes`` hook: the family's classes, its model's ``sanitize``
    first dropping the tensors ``names`` (a tied checkpoint's copies of its embedding, checked
    equal by ``config.for_mlx_lm``: the head is the embedding, nothing is lost)."""
    from mlx_lm.utils import _get_classes

    def classes(config: dict):
        cls, args = _get_classes(config)
        if not names:
            return cls, args

        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if k not in names}
            return cls.sanitize(self, weights) if hasattr(cls, "sanitize") else weights

        return type(cls.__name__, (cls,), {"sanitize": sanitize}), args

    return classes


def split(lm: nn.Module, config: dict, group, path: Path) -> None:
    """This rank's 1/N of ``lm``'s heads and MLP rows (tensor parallelism): the family's own
    ``shard``, else ``shard.llama_like`` where the layers are Llama-shaped; LoadError naming
    the fix when the model cannot be split that many ways, or at all."""
    from ..verifier.shard import ShardError, llama_like

    try:
        if hasattr(lm, "shard"):
            check_split(config, group.size())
            lm.shard(group)
        else:
            llama_like(lm, config, group)
    except ShardError as e:
        raise LoadError(f"{path}: {e}") from None


def load_drafter(path: str | os.PathLike, dtype=None) -> Drafter:
    path = resolve_path(path, "drafter")
    config = read_config(path, "drafter")
    check_not_a_model(config, path)
    try:
        args = DrafterArgs.from_config(config)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{path}/config.json is not a ReDrafter drafter config: {e}") from None
    drafter = Drafter(args)
    weights = read_weights_drafter(path)
    bad = non_finite(weights)
    if bad:
        raise LoadError(
            f"{path}/model.safetensors holds non-finite weights (NaN or infinity in "
            f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), as a diverged training "
            f"run leaves them; such a drafter never gets a draft accepted. Train it again "
            f"(distill with a lower --lr) or use another drafter"
        )
    _apply_weights(drafter, weights, config, dtype or default_dtype(), path)
    drafter.eval()
    drafter.folder = path  # its trained reach (config.json) for the default plan
    return drafter


MODEL_KEYS = ("num_hidden_layers", "num_attention_heads", "intermediate_size")


def check_not_a_model(config: dict, path: Path) -> None:
    """Refuse a base model's folder given as a drafter (its config.json has transformer keys)."""
    found = [k for k in MODEL_KEYS if k in config]
    if found:
        raise LoadError(
            f"{path} is a model, not a drafter (its config.json has {found[0]}, model_type "
            f"{config.get('model_type')!r}); pass it as the model, and as the drafter a folder "
            f"made by 'redrafter-mlx distill' or 'redrafter-mlx convert --drafter'"
        )


def read_weights_drafter(path: Path) -> dict[str, mx.array]:
    file = path / "model.safetensors"
    if not os.path.lexists(file):
        if (path / "pytorch_model.bin").exists():
            raise LoadError(
                f"{path} holds a PyTorch drafter; convert it first: "
                f"redrafter-mlx convert --model <base> --drafter {path} --out <dir>"
            )
        raise LoadError(f"{path} has no model.safetensors")
    return dict(load_checked(file))


def check_pair(model: Verifier, drafter: Drafter) -> None:
    """The drafter must read this LLM's hidden states and embeddings and share its vocabulary:
    the same, or the first ids of the model's when the model grew by added tokens since (an
    APAR model's two split tokens): such a drafter drafts only ids it knows, and the verify
    draws from the whole vocabulary, so output is unchanged."""
    if drafter.args.hidden_size != model.hidden_size:
        raise LoadError(
            f"drafter hidden_size {drafter.args.hidden_size} != model hidden_size "
            f"{model.hidden_size}: this drafter was trained for another base model"
        )
    grown = model.vocab_size - drafter.args.vocab_size
    if not 0 <= grown <= MAX_ADDED_TOKENS:
        raise LoadError(
            f"drafter vocab_size {drafter.args.vocab_size} != model vocab_size "
            f"{model.vocab_size}: this drafter was trained for another base model"
        )
    ids = drafter.args.draft_vocab or []
    if ids and not all(0 <= int(i) < model.vocab_size for i in ids):
        raise LoadError(
            f"the drafter's draft_vocab holds ids outside the model's vocabulary "
            f"[0, {model.vocab_size}): it was trained for another base model"
        )


def attach(model: Verifier, drafter: Drafter | None) -> None:
    """Make ``model`` capture the hidden states ``drafter`` reads (its ``feature_layers``;
    none for a drafter without the key: the forward is then unchanged)."""
    layers = (drafter.args.feature_layers or ()) if drafter is not None else ()
    try:
        model.capture_features(layers)
    except ValueError as e:
        raise LoadError(f"{e}: this drafter was trained for another base model") from None


def load(model_path, drafter_path=None, dtype=None, group=None, draft_model=None):
    """Load (model, drafter or None, tokenizer). dtype: float16 on a GPU, float32 on CPU.

    ``group``: an ``mx.distributed`` group to split the model across (each rank loads its
    shard; the drafter is whole on every rank), None for the whole model here.
    ``draft_model``: what the draft slot loads, one path or a sequence of up to two
    (``draft_slot_paths``): a draft model's folder or Hub id (``load_draft_model``; the
    model's own path: the model itself), an early-exit adapter's folder (config.json kind
    "early-exit": ``load_adapter_for``; its chain joins the recurrent drafter's beams), or
    one of each; then the result is (model, drafter or None, tokenizer, the draft slot: the
    draft model, the adapter, or both as a tuple, ``(draft model, adapter)``).
    """

    if isinstance(dtype, str):
        dtype = getattr(mx, dtype)
    slot = draft_slot_paths(draft_model) if draft_model is not None else None
    model_path = resolve_path(model_path)
    check_not_a_slot_folder(model_path)
    model, path = load_model(model_path, dtype, group)
    drafter = None
    if drafter_path is not None:
        drafter = load_any_drafter(model, drafter_path, dtype)
    tokenizer = read_tokenizer(path)
    if slot is None:
        return model, drafter, tokenizer
    own_path, adapter_path = slot
    adapter = own = None
    if adapter_path is not None:  # an early-exit adapter in the draft slot
        adapter = load_adapter_for(model, resolve_path(adapter_path), dtype, drafter)
    if own_path == SELF_MTP:
        own = self_mtp(model, path, dtype)
    elif own_path is not None:
        where = resolve_path(own_path, "draft model")
        same = where == path and group is None
        kind = None if same else kinds.slot_kind(where)  # checked by draft_slot_paths
        if same:
            own = model
        elif kind is None:
            own = load_draft_model(own_path, model, tokenizer, dtype)
        else:  # a published draft head's folder, or a registered third-party source's
            try:
                if kind in kinds.HEADS:
                    own = head_source(where, model, dtype)
                else:
                    own = kinds.load_source(where, model, tokenizer, dtype)
            except ValueError as e:
                raise LoadError(str(e)) from None
    if own is not None and adapter is not None:
        return model, drafter, tokenizer, (own, adapter)
    return model, drafter, tokenizer, own if own is not None else adapter


SELF_MTP = "self-mtp"  # --draft-model self-mtp: the model's own MTP layers


def self_mtp(model, path: Path, dtype=None):
    """The MTP source of the model's own MTP layers (``mtp.*`` in its checkpoint, which
    mlx-lm's class drops); LoadError in one line when its checkpoint has none."""
    if kinds.kind_of(path) != "mtp":
        raise LoadError(
            f"--draft-model self-mtp: {path} declares no MTP layers (its config.json has no "
            "mtp_num_hidden_layers, or its family's MTP layers are not read here: Qwen3.5 and "
            "Qwen3-Next are); pass a draft model or none"
        )
    try:
        return head_source(path, model, dtype)
    except ValueError as e:
        raise LoadError(f"--draft-model self-mtp: {e}") from None


DRAFTER_KEYS = ("exit_dim", "num_draft_layers")  # keys only a ReDrafter drafter's config has


def folder_kind(where: Path) -> str | None:
    """What the folder ``where`` holds when it is not a model, read from its config.json:
    ``"drafter"`` (a ReDrafter drafter: ``model_type`` recurrent_drafting_drafter, or its
    keys ``DRAFTER_KEYS`` without a model's ``MODEL_KEYS``), ``"early-exit"`` (config.json
    kind "early-exit": ``early_exit.is_early_exit``), else None (a model, or unreadable:
    loading it names that)."""

    try:
        config = json.loads((Path(where) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if is_early_exit(where):
        return "early-exit"
    drafter_keys = any(k in config for k in DRAFTER_KEYS) and not any(
        k in config for k in MODEL_KEYS
    )
    if config.get("model_type") == "recurrent_drafting_drafter" or drafter_keys:
        return "drafter"
    return None


def check_not_a_slot_folder(where: Path, given_as: str = "the model (--model)") -> None:
    """LoadError when ``where``, given as a model (``given_as``: the model, or a draft
    model), holds a drafter or an early-exit adapter (``folder_kind``), naming where it goes;
    an adapter whose config.json's kind is misspelt: ``check_kind``'s message."""
    check_kind(where)
    if given_as.startswith("the model") and kinds.is_source_folder(where):
        raise LoadError(
            f"{where} holds a {kinds.kind_of(where)!r} draft source (its config.json's kind), "
            f"not a model, given as {given_as}: pass it as --draft-model (load's draft_model) "
            "beside the model it drafts for"
        )
    kind = folder_kind(where)
    if kind == "drafter":
        model = "--model" in given_as
        then = (
            "and as the model the base model it was trained for"
            if model
            else ("beside --model (a draft model is a whole model sharing its tokenizer)")
        )
        raise LoadError(
            f"{where} is a ReDrafter drafter's folder, not a model, given as {given_as}: pass "
            f"it as the drafter (--drafter; load's drafter_path), {then}"
        )
    if kind == "early-exit":
        fix = "--draft-model, or --drafter" if "--model" in given_as else "--drafter"
        raise LoadError(
            f"{where} is an early-exit adapter's folder, not a model, given as {given_as}: "
            f"pass it as {fix} (it drafts with the first layers of the model it was trained "
            "for; pass that model as --model)"
        )


def draft_slot_paths(draft_model) -> tuple:
    """What the draft slot loads, as (the draft model's path or Hub id, the early-exit
    adapter's folder), either None, each as given: ``draft_model`` is one path or a
    sequence of up to two, at most one draft model and one adapter (the folder's kind
    tells them apart: ``kinds.slot_kind``; a registered source's folder takes the draft
    model's place, an unregistered kind is refused naming it). TypeError for anything but paths;
    LoadError naming the fix otherwise (an empty path, a folder that is not found or holds
    a drafter, two of a kind, more than two)."""

    single = isinstance(draft_model, (str, os.PathLike))
    given = [draft_model] if single else check_path_list(draft_model)
    if not 1 <= len(given) <= 2:
        raise LoadError(
            f"the draft slot takes one or two paths (a draft model, an early-exit adapter's "
            f"folder, or one of each), got {len(given)}: pass --draft-model once or twice"
        )
    models, adapters = [], []  # a registered source's folder goes where a draft model does
    for p in given:
        if not str(p).strip():
            raise LoadError(
                "the draft model's path is empty (it would name the current folder): pass a "
                "draft model's folder or Hub id, or an early-exit adapter's folder, or none"
            )
        if str(p) == SELF_MTP:  # the model's own MTP layers, read from its checkpoint
            models.append(SELF_MTP)
            continue
        where = resolve_path(p, "draft model")
        check_kind(where)  # a misspelt adapter's kind: that, not an unregistered kind
        try:
            kind = kinds.slot_kind(where)  # the one dispatch on a folder's kind
        except ValueError as e:
            raise LoadError(str(e)) from None
        adapter = kind == kinds.EARLY_EXIT
        if kind is None:
            check_not_a_slot_folder(where, "a draft model (--draft-model)")
        (adapters if adapter else models).append(str(p))
    if len(adapters) > 1:
        raise LoadError(
            f"two early-exit adapters were given for the draft slot ({adapters[0]} and "
            f"{adapters[1]}): it holds one adapter and one draft model at most; pass one "
            "adapter (a second one could only be the drafter, in place of a recurrent one)"
        )
    if len(models) > 1:
        raise LoadError(
            f"two draft models were given for the draft slot ({models[0]} and {models[1]}): "
            "it holds one draft model and one early-exit adapter at most; pass one draft "
            "model (the other --draft-model may be an early-exit adapter's folder)"
        )
    return (models[0] if models else None, adapters[0] if adapters else None)


def check_path_list(draft_model) -> list:
    """``load``'s ``draft_model`` given as several paths: a list or tuple of str or
    ``os.PathLike``; TypeError naming what it takes otherwise (a loaded model belongs in
    ``generate``'s ``draft_model``, not ``load``'s)."""
    takes = (
        "load's draft_model takes a path or Hub id (str or os.PathLike), or a list of two (a "
        "draft model and an early-exit adapter's folder)"
    )
    if not isinstance(draft_model, list | tuple):
        loaded = (
            " (a loaded one goes to generate's draft_model)"
            if hasattr(draft_model, "vocab_size")
            else ""
        )
        raise TypeError(f"{takes}, got {_described(draft_model)}{loaded}")
    bad = [p for p in draft_model if not isinstance(p, str | os.PathLike)]
    if bad:
        raise TypeError(f"{takes}, got a {type(draft_model).__name__} holding {_described(bad[0])}")
    return list(draft_model)


def _described(value) -> str:
    """``value``'s type, and its value when it is a number (short)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{type(value).__name__} {value!r}" if number else type(value).__name__


def load_any_drafter(model: Verifier, path, dtype=None):
    """The drafter in ``path`` for ``model``: a ReDrafter drafter (attached to the model), or
    an early-exit adapter (config.json kind "early-exit": ``early_exit.load_adapter``),
    checked against the model. LoadError naming the problem otherwise."""

    where = resolve_path(path, "drafter")
    check_kind(where)
    if not early_exit.is_early_exit(where):
        drafter = load_drafter(path, dtype)
        check_pair(model, drafter)
        attach(model, drafter)
        return drafter
    return load_adapter_for(model, where, dtype)


def check_kind(where) -> None:
    """LoadError when ``where`` reads as an early-exit adapter whose config.json's kind is
    not "early-exit" (``early_exit.kind_problem``): never loaded as something else."""

    problem = kind_problem(where)
    if problem is not None:
        raise LoadError(problem)


def load_adapter_for(model: Verifier, where: Path, dtype=None, drafter=None):
    """The early-exit adapter in the folder ``where`` (``early_exit.load_adapter``), checked
    against ``model`` and bound to it (``early_exit.pair``), as the drafter or (``drafter``
    given: the run's drafter, which must not be one too) in the draft-model slot. LoadError
    naming the folder otherwise."""

    try:
        adapter = early_exit.load_adapter(where, dtype, target=model.args)
        early_exit.pair(model, adapter)
        held_sources(drafter, adapter)  # not an adapter in both slots
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from None
    return adapter


def load_draft_model(path, model: Verifier, tokenizer=None, dtype=None) -> Verifier:
    """A draft model (``engine/drafting/draft_model.py``) for ``model``: a whole model (never split)
    that must share its tokenizer: the same vocabulary size and, given ``tokenizer``, the
    same ids for the same text. LoadError before anything runs otherwise."""
    from ..base.tokenizer import load_tokenizer

    draft, where = load_model(path, dtype)
    try:
        check_draft_model(model, draft)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from None
    if tokenizer is not None and has_tokenizer(where):  # none there: the vocabulary size only
        try:
            other = load_tokenizer(where)
        except Exception as e:  # a damaged tokenizer file: transformers' errors vary
            raise LoadError(
                f"the draft model's tokenizer in {where} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); fix or re-download its "
                "tokenizer files, or remove them (the vocabulary size is then checked alone)"
            ) from None
        check_same_tokenizer(tokenizer, other, where)
    return draft


TOKENIZER_PROBE = "The quick brown fox, 1234 -- \u00fcn\u00efcode \u4e2d\u6587!\n  f(x)"


def check_same_tokenizer(target, other, where: Path) -> None:
    """The draft model's tokenizer must give the target's ids: every id the same token
    (``Tokenizer.id_tokens``, the whole vocabulary), the target allowed up to
    ``MAX_ADDED_TOKENS`` added ids past the draft model's (as an APAR model's split tokens),
    and the same encoding of a probe text."""
    mine, theirs = target.id_tokens(), other.id_tokens()
    added = len(mine) - len(theirs)
    same = (
        0 <= added <= MAX_ADDED_TOKENS
        and mine[: len(theirs)] == theirs
        and other.encode(TOKENIZER_PROBE) == target.encode(TOKENIZER_PROBE)
    )
    if not same:
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        differs = (
            f"; id {first} is {theirs[first]!r} there, {mine[first]!r} here"
            if first is not None
            else ""
        )
        raise LoadError(
            f"{where} has another tokenizer than the model ({len(theirs)} vs {len(mine)} ids, "
            f"or other ids for the same text{differs}): a draft model must share the model's "
            "tokenizer; pick one of the same family"
        )
