"""Module paths as memory by module keeps them: cut at a depth, and read back level by level. Plain
strings, no torch: the case's child cuts them, the report draws their tree."""

from __future__ import annotations

ROOT = "(model)"  # the model's own parameters and what its forward saves outside any child
NO_MODULE = "(no module)"  # saved outside every module's forward: the loss and what the step adds
COMPILED = "(compiled graph)"  # saved by a compiled step, whose modules run inside one graph


def path_levels(path: str) -> list[str]:
    """The levels of `path`, each the path down to it: an index (a ModuleList's or Sequential's) joins the
    name before it, so `encoder.layers.3.mlp` is `encoder`, `encoder.layers.3`, `encoder.layers.3.mlp`; an
    index after an index is a level of its own (a Sequential in a Sequential: `3`, `3.0`)."""
    if path in ("", ROOT, NO_MODULE, COMPILED):
        return [path or ROOT]
    levels: list[str] = []
    parts: list[str] = []
    for part in path.split("."):
        if part.isdigit() and parts and not parts[-1].isdigit():
            levels.pop()
        parts.append(part)
        levels.append(".".join(parts))
    return levels


def cut_path(path: str, depth: int) -> str:
    """`path` cut to `depth` levels (`path_levels`); the root is `ROOT`."""
    levels = path_levels(path)
    return levels[min(depth, len(levels)) - 1]
