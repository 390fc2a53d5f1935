"""A tokenizer's chat template, found and rendered as ``transformers`` renders it.

Where the template is: ``--chat-template FILE`` when given, else the tokenizer folder's
``chat_template.jinja`` (what transformers 5 saves), else the ``chat_template`` entry of its
``tokenizer_config.json`` (older folders; a list of named templates gives its ``default``).

How it is rendered (the facts of ``transformers.utils.chat_template_utils``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` tag, the filter ``tojson`` (no HTML
escaping, ``ensure_ascii=False``), the globals ``raise_exception``, ``strftime_now``, a
restricted ``dict`` and a ``namespace`` refusing underscore names; the template sees
``messages`` (None-valued keys dropped), ``add_generation_prompt``, ``tools=None``,
``documents=None`` and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...).
Templates are untrusted code: the sandbox is why jinja2 >= 3.1.6 is required.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from moezero.data.common import DataError
from moezero.data.tokenizer import read_json

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_REASONING = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ChatTemplate:
    """A template's text, where it came from, its SHA-256 and the special tokens it sees."""

    text: str
    origin: str
    special: dict = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its ``{% generation %}`` blocks."""
        template = _compile(self.text)
        spans: list[tuple[int, int]] = []
        blocks: list[str] = []
        template.environment.generation_tracker = (blocks, spans)
        try:
            for block in template.generate(messages=_plain_messages(messages), tools=None,
                                           documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **self.special):
                blocks.append(block)
        finally:
            template.environment.generation_tracker = None
        return "".join(blocks), spans

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}``."""
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.text) is not None


def _plain_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to the template: None-valued keys dropped and the
    reasoning of a message under each of its names."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def find(folder: Path, override: Path | None, *, required: bool = True) -> ChatTemplate | None:
    """The chat template of the tokenizer folder ``folder`` (or the file ``override``); None
    when there is none and it is not ``required``.

    Raises:
        DataError: (one line) no template (when required), an unreadable file or a template
            that does not compile.
    """
    special = special_tokens(folder)
    if override is not None:
        return _checked(ChatTemplate(_read(override), str(override), special))
    if (folder / TEMPLATE_FILE).is_file():
        return _checked(ChatTemplate(_read(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE),
                                     special))
    text = _from_config(folder / "tokenizer_config.json")
    if text is None and not required:
        return None
    if text is None:
        raise DataError(f"--tokenizer {folder}: the tokenizer has no chat template (no "
                        f"{TEMPLATE_FILE}, none in tokenizer_config.json); give one with "
                        "--chat-template FILE")
    return _checked(ChatTemplate(text, str(folder / "tokenizer_config.json"), special))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--chat-template {path}: unreadable ({' '.join(str(exc).split())})") \
            from None


def _from_config(path: Path) -> str | None:
    """``tokenizer_config.json``'s ``chat_template``: a string, or named templates' default."""
    value = read_json(path).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def special_tokens(folder: Path) -> dict:
    """The named special tokens as text (``tokenizer_config.json``, then
    ``special_tokens_map.json``), as transformers passes them to the template."""
    out = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = read_json(folder / name)
        for key in SPECIAL_TOKENS:
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if key not in out and isinstance(value, str):
                out[key] = value
    return out


def _checked(template: ChatTemplate) -> ChatTemplate:
    import jinja2

    try:
        _compile(template.text)
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(f"{template.origin}: chat template line {exc.lineno}: {exc.message}") \
            from None
    return template


@lru_cache(maxsize=8)
def _compile(text: str):
    """The compiled template (cached per process: workers render many conversations)."""
    return _environment().from_string(text)


def _environment():
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("jinja2 is needed to render chat templates "
                        "(pip install 'moezero[data]')") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(),
                                                    "jinja2.ext.loopcontrols"])
    env.generation_tracker = None
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_namespace_class(jinja2))
    return env


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict`` inside a template: construction only, no attribute tricks."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(jinja2):
    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore names on a namespace ({name!r})")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _generation_extension():
    """``{% generation %}...{% endgeneration %}``: renders its body and records its character
    span in the text rendered so far (``environment.generation_tracker``)."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body) \
                .set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            tracker = self.environment.generation_tracker
            if tracker is not None:
                blocks, spans = tracker
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    return Generation
