"""A chat record renders in work linear in its turns (issue 38, item 13: 2,000 turns took 31.6 s,
every assistant turn rendering the whole conversation before it twice).

The work is counted, not timed: a counting template records how many messages each render
hands the template, and a counting tokenizer how many characters it encodes. The ids and the
loss mask equal what the per-turn prefix renderings give (``chat._prefix_spans``, the rule the
docs state, kept for templates whose turns are not local) and ``apply_chat_template``'s ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from moezero.data import chat, chat_template
from moezero.data.chat_template import ChatTemplate
from moezero.data.common import DataError
from moezero.data.tokenizer import load_tokenizer
from tests.torch_impl.chat_util import CHATML, MISTRAL, OLMOE, QWEN3, chat_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

SYSTEM = {"role": "system", "content": "Be brief."}


@dataclass(frozen=True)
class CountingTemplate(ChatTemplate):
    """A template that records the number of messages of every render."""

    rendered: list = field(default_factory=list)

    def render(self, messages, *, add_generation_prompt=False):
        self.rendered.append(len(messages))
        return super().render(messages, add_generation_prompt=add_generation_prompt)


class CountingTokenizer:
    """Counts the characters handed to ``encode``."""

    def __init__(self, tok):
        self.tok, self.encoded = tok, 0

    def encode(self, text, **kwargs):
        self.encoded += len(text)
        return self.tok.encode(text, **kwargs)


def turns(n: int, *, tool: bool = False) -> list[dict]:
    """``n`` alternating user/assistant messages with varied text (tool results too)."""
    out = []
    for i in range(n):
        role = ("user", "assistant")[i % 2]
        if tool and i % 6 == 4:
            role = "tool" if i % 2 == 0 else role
        out.append({"role": role, "content": f"the cat {i} sat on mat {i * 7 % 13}."})
    return out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


def counting(template_text, tok_dir) -> CountingTemplate:
    """``template_text`` seeing the special tokens of the tokenizer in ``tok_dir``."""
    return CountingTemplate(template_text, "test", chat_template.special_tokens(tok_dir))


def encode(template_text, messages, tok_dir, train_on="assistant"):
    template = counting(template_text, tok_dir)
    tok = CountingTokenizer(load_tokenizer(tok_dir / "tokenizer.json"))
    ids, mask = chat.encode_record({"messages": messages}, tok,
                                   chat.ChatOptions("chat", train_on, template), eod_id=0)
    return ids, mask, template.rendered, tok.encoded


def test_a_3000_turn_chat_renders_in_work_linear_in_its_turns(tok_dir):
    work = {}
    for n in (300, 3000):
        messages = [SYSTEM, *turns(n)]
        _, _, rendered, encoded = encode(CHATML, messages, tok_dir)
        work[n] = sum(rendered), encoded
    # each message is rendered a bounded number of times (windows of a few messages), and
    # the text is encoded once: ten times the turns, ten times the work (within 2 %)
    assert work[3000][0] <= 25 * 3000, work
    assert work[3000][0] / work[300][0] == pytest.approx(10, rel=0.02), work
    assert work[3000][1] / work[300][1] == pytest.approx(10, rel=0.05), work


CASES = {
    "chatml": (CHATML, [SYSTEM, *turns(9)]),
    "chatml-no-system": (CHATML, turns(8)),
    "chatml-tools": (CHATML, [SYSTEM, *turns(13, tool=True)]),
    "qwen3": (QWEN3, [SYSTEM, *turns(9)]),
    "mistral": (MISTRAL, turns(10)),
    "olmoe": (OLMOE, turns(7)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("train_on", ["assistant", "last-assistant"])
def test_ids_and_mask_equal_the_prefix_renderings_and_apply_chat_template(tmp_path, case,
                                                                         train_on):
    template, messages = CASES[case]
    tok_dir = chat_tokenizer(tmp_path / "tok", template)
    ids, mask, _, _ = encode(template, messages, tok_dir, train_on)
    reference = counting(template, tok_dir)
    text, _ = chat._render(reference, messages, False)
    turn_ids = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = chat._prefix_spans(reference, messages, turn_ids, text)
    assert sum(reference.rendered) > len(messages) ** 2 / 4  # the quadratic rule, as before
    assert chat._windowed_spans(reference, messages, turn_ids, text) == spans  # turns local
    spans = spans[-1:] if train_on == "last-assistant" else spans
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    encoding = tok.encode(text, add_special_tokens=False)
    assert ids == encoding.ids
    assert mask.tolist() == chat._mask(encoding.offsets, spans, train_on).tolist()
    assert mask.sum() > 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert ids == hf.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_a_template_whose_turns_are_not_local_falls_back_to_the_prefix_renderings(tok_dir):
    """Qwen3 keeps reasoning only after the last query: a window sees another last query, its
    pieces do not tile the conversation, so the prefix renderings decide (and refuse)."""
    messages = [*turns(2), *turns(2)]
    messages[1] = {**messages[1], "reasoning_content": "hmm"}
    with pytest.raises(DataError, match="renders the turns before assistant message 1"):
        encode(QWEN3, messages, tok_dir)


def test_the_mask_of_many_spans_equals_the_overlap_rule():
    """``_mask`` with sorted, merged spans equals transformers' rule token by token, touching
    and overlapping spans, empty tokens and empty spans included."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = np.sort(rng.integers(0, 60, 30))
        offsets = [(int(s), int(s + rng.integers(0, 4))) for s in starts]
        spans = [tuple(sorted(map(int, rng.integers(0, 64, 2)))) for _ in range(5)]
        want = np.zeros(len(offsets), dtype=bool)
        for lo, hi in spans:
            want |= [(e > lo) and (s < hi) for s, e in offsets]
        assert chat._mask(offsets, spans, "assistant").tolist() == want.astype(int).tolist()
