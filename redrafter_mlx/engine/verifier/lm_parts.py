"""Where in an mlx-lm model the engine finds what it reads (``lm_model.LmModel``): the
module that runs the layers and the layers list, the input embedding table, the output
layer. Families name and nest them differently; these look by the names families use."""

from __future__ import annotations

import mlx.nn as nn


def layers_owner(model: nn.Module) -> tuple[nn.Module, list]:
    """The module below ``model`` that runs the layers, and the layers list (breadth first):
    the module holding the list, or, where that is a container never called (PLaMo's
    ``PlamoDecoder``, iterated by its parent), its parent."""
    queue = [(child, model) for child in model.children().values() if isinstance(child, nn.Module)]
    while queue:
        module, parent = queue.pop(0)
        layers = layer_list(module)
        if layers is not None:
            return (module if callable(module) else parent), layers
        queue += [(c, module) for c in module.children().values() if isinstance(c, nn.Module)]
    raise ValueError(f"{type(model).__module__} has no module holding its layers")


LAYER_LISTS = ("layers", "h", "blocks")  # what families call their list of blocks


def layer_list(module: nn.Module) -> list | None:
    """The module's list of blocks, if it holds one."""
    for name in LAYER_LISTS:
        layers = module.get(name)
        if isinstance(layers, list) and layers and isinstance(layers[0], nn.Module):
            return layers
    return None


EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings")


EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings")


def embedding_of(owner: nn.Module, lm: nn.Module) -> nn.Module:
    """The input embedding table: the layers' module's, else its parent's (PLaMo 3 runs its
    layers in a module below the table), by name first, else the first table below it."""
    parents = [m for _, m in lm.named_modules() if any(c is owner for c in m.children().values())]
    for module in (owner, *parents):
        for name in EMBEDDINGS:
            child = module.get(name)
            if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
                return child
    for _, child in owner.named_modules():
        if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
            return child
    raise ValueError("the model has no input embedding table")


def head_layer(lm: nn.Module, embedding: nn.Module) -> nn.Module:
    """The output layer: the model's own ``lm_head`` (or ``output``), else the tied embedding."""
    for name in ("lm_head", "output"):
        head = lm.get(name)
        if isinstance(head, (nn.Linear, nn.QuantizedLinear)):
            return head
    return embedding
