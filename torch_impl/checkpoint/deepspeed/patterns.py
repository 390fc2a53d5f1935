"""Name patterns: DeepSpeed parameter names -> moezero FQNs, for modules the Hugging Face
mapping does not know (DeepSpeed's native ``deepspeed.moe.layer.MoE`` inside a decoder).

A pattern file is a small YAML mapping ``DeepSpeed pattern: moezero pattern``; ``{L}`` is a
layer number, ``{E}`` a global expert number, ``*`` any run of characters (dots included).
The defaults below cover DeepSpeed's own gate (``deepspeed_moe.gate.wg``) and experts whose
three projections are named ``w1/w3/w2`` or ``gate_proj/up_proj/down_proj``; a file given
with ``--names`` is tried first.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from moezero.plan.store import CheckpointError

_E = "*deepspeed_moe.experts.deepspeed_experts.{E}."
DEFAULTS = {
    "model.layers.{L}.*deepspeed_moe.gate.wg.weight": "layers.{L}.moe.router.weight",
    **{f"model.layers.{{L}}.{_E}{ds}.weight": f"layers.{{L}}.moe.experts.{{E}}.{w}.weight"
       for ds, w in (("w1", "w1"), ("w3", "w3"), ("w2", "w2"), ("gate_proj", "w1"),
                     ("up_proj", "w3"), ("down_proj", "w2"))},
}


def load(path: Path | None) -> dict[str, str]:
    """The file's patterns (first) and the defaults."""
    if path is None:
        return dict(DEFAULTS)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"--names {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in data.items()):
        raise CheckpointError(f"--names {path}: expected a mapping 'DeepSpeed pattern: moezero "
                              "pattern'")
    return {**data, **{k: v for k, v in DEFAULTS.items() if k not in data}}


def _regex(pattern: str) -> re.Pattern:
    out = re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(out.replace(r"\*", ".*?"))


def by_fqn(names, patterns: dict[str, str]) -> dict[str, str]:
    """{moezero FQN: DeepSpeed name} for every name a pattern matches (the first that does)."""
    compiled = [(_regex(k), v) for k, v in patterns.items()]
    out = {}
    for name in names:
        for regex, target in compiled:
            m = regex.fullmatch(name)
            if m:
                fqn = target.format(**m.groupdict())
                if fqn in out:
                    raise CheckpointError(f"DeepSpeed params {out[fqn]} and {name} both map to "
                                          f"{fqn}")
                out[fqn] = name
                break
    return out
