"""Chat and prompt-completion records -> token ids and a loss mask (``prepare-data --format``).

A ``chat`` record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` with roles
``system``, ``user``, ``assistant`` and ``tool``. It is rendered with the tokenizer's chat template
(:mod:`moezero.data.chat_template`) and the text encoded without the tokenizer's added special
tokens, as ``AutoTokenizer.apply_chat_template(messages, tokenize=True)`` does, so the ids are the
same. No end-of-document id is appended: the template ends its turns itself.

Which characters are the assistant's: the ``{% generation %}`` spans when the template has them;
otherwise, for assistant message ``i``, the text that rendering ``messages[:i+1]`` adds to
rendering ``messages[:i]`` with the generation prompt (the reply, its end-of-turn token and what
the template writes after it). Both renderings must be prefixes of the whole conversation's;
a template that rewrites earlier turns (e.g. drops their reasoning) is refused in one line. A
token is trained when its character span overlaps an assistant span (transformers' rule for
``return_assistant_tokens_mask``).

Rendering every prefix costs time quadratic in the turns (2,000 turns took 31.6 s), so each
message's piece is first rendered in a window: the first message, then at most
``WINDOW_LOOKBACK`` messages before it (an even shift, so ``loop.index0`` keeps its parity).
When the pieces tile the whole rendering exactly, the turns are local and the spans come from
the windows (work linear in the turns); otherwise the prefixes are rendered as stated above.

A ``prompt-completion`` record is ``{"prompt": ..., "completion": ...}``: two strings are plain
text (``prompt + completion`` encoded with the tokenizer's own special tokens, then the
end-of-document id); two message lists are rendered as one chat, the completion being what the
full rendering adds to the prompt's rendering with the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from moezero.data.chat_template import ChatTemplate
from moezero.data.common import DataError, lone_surrogate

ROLES = ("system", "user", "assistant", "tool")
WINDOW_LOOKBACK = 3  # messages of context before each message in its window
TrainOn = Literal["all", "assistant", "last-assistant"]


@dataclass(frozen=True)
class ChatOptions:
    """How records become tokens: the input format, what is trained, the template."""

    format: Literal["chat", "prompt-completion"]
    train_on: TrainOn = "assistant"
    template: ChatTemplate | None = None


def encode_record(record: dict, tok, options: ChatOptions, eod_id: int
                  ) -> tuple[list[int], np.ndarray]:
    """The token ids of one record and its mask (uint8, 1 = trained).

    Raises:
        DataError: (one line, without the record's location: the caller adds it) a malformed
            record or one the template refuses.
    """
    if options.format == "chat":
        messages = _messages(record, "messages")
        text, spans = _chat_spans(options.template, messages, options.train_on)
        encoding = tok.encode(text, add_special_tokens=False)
        return encoding.ids, _mask(encoding.offsets, spans, options.train_on)
    prompt, completion = _field(record, "prompt"), _field(record, "completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        for key, text in (("prompt", prompt), ("completion", completion)):
            if (where := lone_surrogate(text)) is not None:
                raise DataError(f"{key!r} holds a lone surrogate ({where})")
        return _plain_completion(tok, prompt, completion, eod_id, options.train_on)
    if isinstance(prompt, list) and isinstance(completion, list):
        if options.template is None:
            raise DataError("message lists need a chat template and the tokenizer has none; "
                            "give one with --chat-template FILE")
        messages = _messages(record, "prompt") + _messages(record, "completion")
        text, span = _completion_span(options.template, messages, len(prompt))
        encoding = tok.encode(text, add_special_tokens=False)
        return encoding.ids, _mask(encoding.offsets, [span], options.train_on)
    raise DataError("'prompt' and 'completion' must both be strings or both be "
                    "message lists")


def _field(record: dict, key: str):
    if key not in record:
        raise DataError(f"no field {key!r}")
    return record[key]


def _messages(record: dict, key: str) -> list[dict]:
    """``record[key]`` checked: a non-empty list of messages with known roles."""
    messages = _field(record, key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{key!r} must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{key}[{i}] is a {type(message).__name__}, expected an "
                            "object with 'role' and 'content'")
        if message.get("role") not in ROLES:
            raise DataError(f"{key}[{i}] has role {message.get('role')!r}; expected "
                            f"one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise DataError(f"{key}[{i}] 'content' is "
                            f"{type(content).__name__}, expected a string")
        if isinstance(content, str) and (where := lone_surrogate(content)) is not None:
            raise DataError(f"{key}[{i}] 'content' holds a lone surrogate ({where})")
    return messages


def _render(template: ChatTemplate, messages: list[dict], prompt: bool):
    import jinja2

    try:
        return template.render(messages, add_generation_prompt=prompt)
    except jinja2.TemplateError as exc:
        raise DataError(f"the chat template ({template.origin}) refused the "
                        f"conversation: {' '.join(str(exc).split())[:200]}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
        # the template is the user's code: its own bugs fail on the record, in one line
        raise DataError(f"the chat template ({template.origin}) failed on the conversation: "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None


def _chat_spans(template: ChatTemplate, messages: list[dict], train_on: TrainOn
                ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans to train on."""
    text, marked = _render(template, messages, False)
    if train_on == "all":
        return text, [(0, len(text))]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"no assistant message (nothing to train on with "
                        f"--train-on {train_on})")
    if template.has_generation_markers:
        spans = marked
    else:
        spans = _windowed_spans(template, messages, turns, text)
        if spans is None:
            spans = _prefix_spans(template, messages, turns, text)
    return text, spans[-1:] if train_on == "last-assistant" else spans


def _prefix_spans(template: ChatTemplate, messages: list[dict], turns: list[int], text: str
                  ) -> list[tuple[int, int]]:
    """The assistant spans by rendering every prefix (the rule; quadratic in the turns)."""
    return [_turn_span(template, messages, i, text) for i in turns]


def _windowed_spans(template: ChatTemplate, messages: list[dict], turns: list[int], text: str
                    ) -> list[tuple[int, int]] | None:
    """The assistant spans from each message's piece rendered in its window, or None when the
    pieces do not tile ``text`` (the template's turns are not local)."""
    first, _ = _render(template, messages[:1], False)
    pieces, spans, offset = [first], {0: (0, len(first))}, len(first)
    for k in range(1, len(messages)):
        start = max(1, k - WINDOW_LOOKBACK)
        window = messages[:1] + messages[start + (start % 2 == 0):k]
        try:
            piece = _window_piece(template, window, messages[k])
        except DataError:
            return None
        if piece is None:
            return None
        added, prompt = piece
        spans[k] = (offset + prompt, offset + len(added))
        pieces.append(added)
        offset += len(added)
    return [spans[i] for i in turns] if "".join(pieces) == text else None


def _window_piece(template: ChatTemplate, window: list[dict], message: dict
                  ) -> tuple[str, int] | None:
    """What ``message`` adds to the rendering of ``window`` and, for an assistant message,
    the length of the generation prompt it begins with; None when the renderings are not
    prefixes of each other."""
    before, _ = _render(template, window, False)
    through, _ = _render(template, [*window, message], False)
    if not through.startswith(before):
        return None
    prompt = before
    if message["role"] == "assistant":
        prompt, _ = _render(template, window, True)
        if not (prompt.startswith(before) and through.startswith(prompt)):
            return None
    return through[len(before):], len(prompt) - len(before)


def _turn_span(template: ChatTemplate, messages: list[dict], i: int, text: str
               ) -> tuple[int, int]:
    """What assistant message ``i`` adds to the rendering of the messages before it."""
    before, _ = _render(template, messages[:i], True) if i else ("", [])
    through, _ = _render(template, messages[:i + 1], False)
    if not (text.startswith(through) and through.startswith(before)):
        raise DataError("the chat template renders the turns before assistant "
                        f"message {i} differently once later messages follow, so its tokens "
                        "cannot be located; give a template with {% generation %} markers "
                        "(--chat-template FILE) or use --train-on all")
    return len(before), len(through)


def _completion_span(template: ChatTemplate, messages: list[dict], num_prompt: int
                     ) -> tuple[str, tuple[int, int]]:
    text, _ = _render(template, messages, False)
    before, _ = _render(template, messages[:num_prompt], True)
    if not text.startswith(before):
        raise DataError("the chat template renders the prompt differently once the "
                        "completion follows, so the completion cannot be located")
    return text, (len(before), len(text))


def _plain_completion(tok, prompt: str, completion: str, eod_id: int, train_on: TrainOn
                      ) -> tuple[list[int], np.ndarray]:
    """``prompt + completion`` with the tokenizer's special tokens and the end-of-document id;
    trained from the first token that reaches into the completion."""
    encoding = tok.encode(prompt + completion, add_special_tokens=True)
    ids = list(encoding.ids)
    if ids[-1:] != [eod_id]:
        ids.append(eod_id)
    mask = np.zeros(len(ids), dtype=np.uint8)
    ends = [end for _, end in encoding.offsets]
    first = next((k for k, end in enumerate(ends) if end > len(prompt)), len(ends))
    mask[0 if train_on == "all" else first:] = 1
    return ids, mask


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], train_on: TrainOn
          ) -> np.ndarray:
    """1 for every token whose characters overlap a span (all tokens for ``all``)."""
    if train_on == "all":
        return np.ones(len(offsets), dtype=np.uint8)
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    ends = np.fromiter((e for _, e in offsets), dtype=np.int64, count=len(offsets))
    los, his = _merged(spans)
    # the last span starting before a token's end reaches furthest (merged spans: his sorted)
    last = np.searchsorted(los, ends, side="left") - 1
    reach = np.where(last >= 0, his[np.maximum(last, 0)], np.iinfo(np.int64).min)
    return (reach > starts).astype(np.uint8)


def _merged(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The spans sorted, overlapping ones merged (touching ones kept apart: an empty token at
    their border overlaps neither), as arrays of starts and ends; ends come out sorted too."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    arr = np.array(merged, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]
