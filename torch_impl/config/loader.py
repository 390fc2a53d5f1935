"""Loading a config: defaults, then a YAML/JSON file, then ``--set key=value`` overrides;
writing it back (``dump_config``) so that loading the dump gives an equal config.

Every bad input becomes a :class:`ConfigError` whose message is one line naming the dotted
key and where it was set, e.g. ``zero_optimization.stagee: unknown key (run.yaml)``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from moezero.config.errors import ConfigError, FieldError, one_line
from moezero.config.schema import Config

DEFAULT_RECIPE = Path(__file__).parent.parent / "recipes" / "default.yaml"
"""The shipped recipe; equal to ``Config()``."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` / ``5e7`` as floats (YAML 1.2), not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_override(text: str) -> tuple[list[str], object]:
    """Parse ``a.b.c=value`` into ``(["a", "b", "c"], value)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(key or "--set", "expected KEY=VALUE (no '=')", f"--set {text}")
    path = key.split(".")
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) for part in path):
        raise ConfigError(key or "--set", "bad key: expected dotted names like a.b.c", f"--set {text}")
    try:
        value = parse_value(raw)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"value is not valid YAML: {_first_line(e)}", f"--set {text}") from None
    return path, value


def parse_value(raw: str) -> object:
    """A ``--set`` value: YAML when the whole text is one YAML value, else the text itself (so
    ``/data/ck #2`` stays as written instead of losing a "comment"); empty is None."""
    text = raw.strip()
    if not text:
        return None
    node = yaml.compose(text, Loader=_Loader)
    if node is None or node.end_mark.index < len(text):  # YAML would drop a comment
        return text
    return yaml.load(text, Loader=_Loader)


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the file at ``path`` (YAML, or JSON by suffix), then ``--set`` overrides.

    Raises:
        ConfigError: on any bad input, with a one-line message naming the dotted key.
    """
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if path is not None:
        data = _canonical_tree(Config, _read_file(path), (), os.fspath(path))
        for leaf in _leaves(data):
            sources[leaf] = os.fspath(path)
    for text in overrides:
        keys, value = parse_override(text)
        where = f"--set {text}"
        keys, model = _canonical_keys(keys, where)
        if model is not None and isinstance(value, dict):
            value = _canonical_tree(model, value, tuple(keys), where)
        _set_path(data, keys, value, where)
        for leaf in _leaves(value, tuple(keys)):
            sources[leaf] = where
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise _convert(e, sources) from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, with the keys users write (``checkpoint.async``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML; ``load_config(path)`` gives back an equal config."""
    Path(path).write_text(to_yaml(cfg))


def _read_file(path: str | os.PathLike) -> dict[str, Any]:
    where = os.fspath(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("config", "file not found", where) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("config", f"cannot read file: {_first_line(e)}", where) from None
    try:
        if Path(path).suffix.lower() == ".json":
            data = _unique(json.loads(text, object_pairs_hook=_Pairs), (), where)
        else:
            _check_unique_yaml(yaml.compose(text, Loader=_Loader), (), where)
            data = yaml.load(text, Loader=_Loader)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError("config", f"not valid {_kind(path)}: {_first_line(e)}", where) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"top level must be a mapping, got {type(data).__name__}", where)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(str(bad[0]), "keys must be strings", where)
    return data


class _Pairs(list):
    """A JSON object's (key, value) pairs in order, before duplicates are looked for."""


def _unique(value: object, path: tuple[str, ...], where: str) -> object:
    """JSON objects read as ``_Pairs`` made dicts; ConfigError naming a key given twice."""
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            if key in out:
                raise ConfigError(".".join((*path, key)), "given twice", where)
            out[key] = _unique(item, (*path, key), where)
        return out
    if isinstance(value, list):
        return [_unique(item, path, where) for item in value]
    return value


def _check_unique_yaml(node: yaml.Node | None, path: tuple[str, ...], where: str) -> None:
    """ConfigError naming the first mapping key a YAML document gives twice (and its lines)."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_unique_yaml(item, path, where)
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[object, int] = {}
    for key_node, value_node in node.value:
        key, line = key_node.value, key_node.start_mark.line + 1
        dotted = (*path, str(key))
        if key in lines:
            raise ConfigError(".".join(dotted), f"given twice (lines {lines[key]} and {line})",
                              where)
        lines[key] = line
        _check_unique_yaml(value_node, dotted, where)


def _field(model: type[BaseModel] | None, key: str) -> FieldInfo | None:
    """A model's field by name or by alias."""
    if model is None:
        return None
    fields = model.model_fields
    return fields.get(key) or next((f for f in fields.values() if f.alias == key), None)


def _sub_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    field = _field(model, key)
    ann = field.annotation if field else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _alias(model: type[BaseModel] | None, key: str) -> str:
    field = _field(model, key)
    return field.alias if field and field.alias else key


def _canonical_keys(keys: list[str], where: str) -> tuple[list[str], type[BaseModel] | None]:
    """Field names to the keys users write (``async_save`` -> ``async``); the model at the end."""
    model: type[BaseModel] | None = Config
    is_value = False
    for i, key in enumerate(keys):
        if model is None:  # keys[i-1] was unknown (pydantic reports it) or a value:
            if is_value:
                raise ConfigError(".".join(keys[:i]), "is a value, not a section", where)
            return keys, None
        is_value = _field(model, key) is not None and _sub_model(model, key) is None
        keys = [*keys[:i], _alias(model, key), *keys[i + 1:]]
        model = _sub_model(model, key)
    return keys, model


def _canonical_tree(model: type[BaseModel], data: dict, prefix: tuple[str, ...], where: str) -> dict:
    out: dict[str, Any] = {}
    for key, value in data.items():
        canon = _alias(model, key)
        if canon in out:
            raise ConfigError(".".join((*prefix, canon)), f"given twice (also as '{key}')", where)
        sub = _sub_model(model, key)
        if sub is not None and isinstance(value, dict):
            value = _canonical_tree(sub, value, (*prefix, canon), where)
        out[canon] = value
    return out


def _set_path(data: dict[str, Any], keys: list[str], value: object, where: str) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(".".join(keys[: i + 1]), "is not a section, cannot set keys under it", where)
        node = child
    last = keys[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        _deep_merge(node[last], value)
    else:
        node[last] = value


def _deep_merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


def _leaves(value: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*prefix, str(k)))]
    return [prefix]


def _convert(exc: ValidationError, sources: dict[tuple[str, ...], str]) -> ConfigError:
    """A pydantic ValidationError as one ConfigError (first error named; the rest joined)."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        problem = err["msg"]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc, problem = (*loc, *cause.field.split(".")), cause.problem
        elif err["type"] == "extra_forbidden":
            problem = "unknown key" + _suggest(loc, err.get("input"))
        elif not isinstance(err.get("input"), dict | list):
            problem = f"{problem}, got {_short(err.get('input'))}"
        parts.append((loc, problem))
    (loc0, problem0), rest = parts[0], parts[1:]
    more = [f"{'.'.join(loc) or 'config'}: {problem} ({_where(loc, sources)})"
            for loc, problem in rest[:2]]
    if len(rest) > 2:
        more.append(f"and {len(rest) - 2} more")
    return ConfigError(".".join(loc0) or "config", problem0, _where(loc0, sources), more)


def _where(loc: tuple[str, ...], sources: dict[tuple[str, ...], str]) -> str:
    """Which input set ``loc`` (or, if it was left at its default, its nearest set sibling)."""
    for n in range(len(loc), -1, -1):
        hits = [src for key, src in sources.items() if key[:n] == loc[:n] or key == loc[:len(key)]]
        if hits:
            return ", ".join(dict.fromkeys(reversed(hits)))
    return "defaults"


def _suggest(loc: tuple[str, ...], value: object) -> str:
    """``; did you mean 'a.b.c'?`` with the full key closest to the unknown ``loc[-1]``: a key of
    its section it is a prefix of, else difflib's nearest; the keys set under it follow when
    they are one path of the suggested section (``zero.stage`` -> ``zero_optimization.stage``)."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        model = _sub_model(model, part)
    close = _closest(loc[-1], model)
    if close is None:
        return ""
    return f"; did you mean '{'.'.join((*loc[:-1], close, *_known_path(model, close, value)))}'?"


def _names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _closest(key: str, model: type[BaseModel] | None) -> str | None:
    if model is None:
        return None
    names = _names(model)
    prefixed = [n for n in names if n.startswith(key)] if len(key) >= 3 else []
    close = prefixed or difflib.get_close_matches(key, names, n=1)
    return close[0] if close else None


def _known_path(model: type[BaseModel], key: str, value: object) -> tuple[str, ...]:
    """The keys under ``value`` when they form one path of known keys below ``model.key``."""
    path: list[str] = []
    while isinstance(value, dict) and len(value) == 1:
        model = _sub_model(model, key)
        key, value = next(iter(value.items()))
        if model is None or key not in _names(model):
            return ()
        path.append(key)
    return tuple(path)


def _kind(path: str | os.PathLike) -> str:
    return "JSON" if Path(path).suffix.lower() == ".json" else "YAML"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(exc: BaseException) -> str:
    return one_line(str(exc))
