"""benchmarks/report.py: a run of one self-contained series rewrites only its own section of
an existing BENCHMARKS.md (``report.splice`` / ``report.write(only=...)``)."""

from __future__ import annotations

from benchmarks import report, tables_comm

OLD = "# Benchmarks\n\nintro\n\n## A\n\nold a\n\n## B\n\nold b\n\n\n## Not run, rejected or failed\n\n- x\n"


def test_splice_replaces_a_section_with_the_same_heading_and_nothing_else():
    text = report.splice(OLD, [["## B", "", "new b"]])
    assert text == OLD.replace("old b\n", "new b")


def test_splice_inserts_a_new_section_before_the_failures():
    text = report.splice(OLD, [["## C", "", "c"]])
    assert text == OLD.replace("\n\n## Not run", "\n\n## C\n\nc\n\n## Not run")
    assert report.splice(text, [["## C", "", "c2"]]) == text.replace("\nc\n", "\nc2\n")


def test_a_collectives_run_writes_only_its_section(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(OLD)
    results = {"runs": [], "size": {}, "machine": {}, "mode": "quick"}
    written = report.write(results, out, tmp_path / "plots", only=["collectives"])
    assert written.startswith(tables_comm.HEADING) and "Not run in this report." in written
    assert out.read_text() == OLD.replace("\n\n## Not run", f"\n\n{written}\n\n## Not run")
    assert not (tmp_path / "plots").exists()  # no plot was redrawn
