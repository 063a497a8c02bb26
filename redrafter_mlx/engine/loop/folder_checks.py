"""What a model folder must hold besides a config mlx-lm builds, checked at load with a
message that names the problem, where it is, and the fix (``loading.load`` and
``loading.load_model``): a tokenizer, and finite weights.
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..verifier.config import transformers_rejects
from ..verifier.weight_files import LoadError, check_weight_file, non_finite

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary file (a tokenizer_config.json alone
    does not make one)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


STRICT = "StrictDataclassFieldValidationError"  # transformers' (huggingface_hub's) check


def strict_config(error: Exception, path: Path) -> str:
    """One line for transformers' strict validation of ``path``'s config.json (read while
    the tokenizer loads), whose message takes two: the field, and why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    why = lines[-1] if lines else type(error).__name__
    field = getattr(error, "field", None)
    named = f"field {field!r}: " if isinstance(field, str) else ""
    return (
        f"{path}/config.json is rejected by transformers' config validation ({named}{why}); "
        "fix that field's value to the type it names, or download the config again"
    )


def read_tokenizer(path: Path):
    """The model's tokenizer (``base.tokenizer.load_tokenizer``), or LoadError: none in
    ``path`` (no vocabulary file, and none loads: the files were removed or never copied),
    a config.json transformers' strict validation rejects (read for the tokenizer's
    class), or one that cannot be read."""
    from ..base.tokenizer import load_tokenizer

    missing = (
        f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
        "tokenizer files of the model it was made from into it, or download the model again"
    )
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # transformers' errors for a missing or damaged tokenizer vary
        if not has_tokenizer(path):
            raise LoadError(missing) from None
        if type(e).__name__ == STRICT:
            raise LoadError(strict_config(e, path)) from None
        if rejected := transformers_rejects(path, e):  # config.json, not the tokenizer
            raise LoadError(rejected) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise LoadError(
            f"the tokenizer in {path} cannot be read ({type(e).__name__}: {first}); fix or "
            "download its tokenizer files again"
        ) from None
    if not has_tokenizer(path) and not tokenizer.encode("Hello"):
        raise LoadError(missing)
    return tokenizer


def check_finite(lm: nn.Module, files: list[Path], path: Path) -> None:
    """LoadError naming the tensors (and the file of the first) that hold a NaN or an
    infinity, among every float weight of ``lm`` (loaded: one reduction per tensor)."""
    bad = non_finite(dict(tree_flatten(lm.parameters())))
    if not bad:
        return
    file = next((f.name for f in files if bad[0] in check_weight_file(f)), None)
    where = f" in {file}" if file else ""
    named = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    raise LoadError(
        f"{path}: the weights hold NaN or infinity ({named}{where}), as a diverged training "
        "run or a damaged conversion leaves them, and such a model decodes garbage: download "
        "or convert the model again"
    )
