"""The packaged recipes (``moezero/recipes/*.yaml``) by name: ``--config NAME`` and
``moezero recipes``.

Each recipe's first line says what it is for, ``# recipe: MODEL | HARDWARE | ESTIMATE ARGS``
(e.g. ``--nproc 8 --device cuda``); ``listing`` prints one line per recipe with the peak that
``moezero estimate`` predicts for it with those arguments (computed from the config, without
its ``checkpoint.load``: the base a recipe names is not on this machine).
"""

from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path
from typing import NamedTuple

from moezero.config import ConfigError, load_config

RECIPES = Path(__file__).parent / "recipes"
"""The folder of the packaged recipes."""
HEADER = "# recipe:"


class Recipe(NamedTuple):
    """A packaged recipe and its header line."""

    name: str
    path: Path
    model: str
    hardware: str
    nproc: int
    device: str


def recipes(folder: Path = RECIPES) -> list[Recipe]:
    """Every recipe in ``folder``, sorted by name."""
    return [read_recipe(path) for path in sorted(folder.glob("*.yaml"))]


def read_recipe(path: Path) -> Recipe:
    """A recipe's header (``# recipe: MODEL | HARDWARE | --nproc N --device D``)."""
    first = path.read_text().partition("\n")[0]
    parts = [p.strip() for p in first.removeprefix(HEADER).split("|")]
    if not first.startswith(HEADER) or len(parts) != 3:
        raise ConfigError("config", f"first line must be '{HEADER} MODEL | HARDWARE | --nproc N "
                                    "--device D'", os.fspath(path))
    args = shlex.split(parts[2])
    opts = dict(zip(args[::2], args[1::2], strict=False))
    return Recipe(path.stem, path, parts[0], parts[1], int(opts.get("--nproc", 1)),
                  opts.get("--device", "cuda"))


def resolve(config: str | None, folder: Path = RECIPES) -> str | None:
    """``--config``: an existing file or a path (anything with a folder in it) as given; else
    the packaged recipe of that name (``.yaml`` optional). ConfigError (one line, the close
    names, or all of them) when there is neither."""
    if config is None or os.path.exists(config) or os.sep in config or "/" in config:
        return config
    names = [r.stem for r in sorted(folder.glob("*.yaml"))]
    name = config.removesuffix(".yaml").removesuffix(".yml")
    if name in names:
        return os.fspath(folder / f"{name}.yaml")
    close = difflib.get_close_matches(name, names, n=4, cutoff=0.5)
    hint = f"close: {', '.join(close)}" if close else f"known: {', '.join(names)}"
    raise ConfigError("config", f"no such file, and no packaged recipe '{name}' ({hint}; "
                                "moezero recipes lists them)", config)


def peak_text(recipe: Recipe) -> str:
    """The estimate's predicted peak per rank of ``recipe`` on its hardware."""
    from moezero.estimate import estimate  # builds the plan on the meta device: torch

    cfg = load_config(recipe.path, ["checkpoint.load=null"])
    est = estimate(cfg, recipe.nproc, device=recipe.device)
    host = f"{est.peak('cpu') / 2**30:.1f} GiB host"
    if recipe.device == "cpu":  # the compute device is the host: one figure, its RSS
        peak = host
    else:
        peak = f"{est.peak('device') / 2**30:.1f} GiB GPU" + (
            f" + {host}" if est.peak("cpu") >= 2**30 / 20 else "")
    return f"peak {peak} per rank (moezero estimate --nproc {recipe.nproc})"


def listing(folder: Path = RECIPES) -> str:
    """``moezero recipes``: one line per packaged recipe: name, model, hardware, peak."""
    rows = recipes(folder)
    width = max((len(r.name) for r in rows), default=0)
    model = max((len(r.model) for r in rows), default=0)
    hardware = max((len(r.hardware) for r in rows), default=0)
    return "\n".join(f"{r.name:<{width}}  {r.model:<{model}}  {r.hardware:<{hardware}}  "
                     f"{peak_text(r)}" for r in rows)
