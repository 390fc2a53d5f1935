"""benchmarks/gated_delta.py: both sides compute the same rule on the benchmark's inputs (the
differences it reports are small), the document-starts side really restarts the state, and
the section reports each length's tokens/s for both passes. Tiny sizes: about a second."""

from __future__ import annotations

import pytest

from benchmarks import gated_delta as gd

pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
TINY = {"batch": 2, "heads": 2, "head_dim": 8, "lengths": (40,), "repeats": 1}


def test_both_sides_agree_and_document_starts_restart_the_state():
    data = gd.inputs(TINY, 40)
    mine, theirs = gd.moezero_rule(**data), gd.hf_rule(**data)
    assert mine.shape == theirs.shape == (2, 40, 2, 8)
    assert (mine - theirs).abs().max() < 1e-5
    starts = gd.doc_starts(2, 40)
    assert starts[:, ::10].all() and starts.sum() == 2 * gd.DOCS
    packed = gd.moezero_rule(**data, starts_BS=starts)
    second = {k: v[:, 10:20] for k, v in data.items()}  # the second document alone
    assert (packed[:, 10:20] - gd.hf_rule(**second)).abs().max() < 1e-5
    assert (packed[:, 10:20] - mine[:, 10:20]).abs().max() > 1e-3


def test_the_section_reports_both_passes_at_each_length():
    res = gd.measure(TINY, repeats=1)
    (row,) = res["rows"]
    assert row["max_abs_out"] < 1e-5 and row["max_abs_grad"] < 1e-5
    text = "\n".join(gd.section(res, "python -m benchmarks.gated_delta", "d"))
    assert text.startswith(gd.SECTION)
    assert "| 40 | forward |" in text and "| 40 | forward + backward |" in text
