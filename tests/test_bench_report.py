"""benchmarks/report.py: a run of the ``collectives`` series alone rewrites only its own section
of an existing BENCHMARKS.md (``report.update_sections``), leaving every other byte."""

from __future__ import annotations

from benchmarks import report, tables_comm

OLD = "# Benchmarks\n\nintro\n\n## A\n\nold a\n\n## B\n\nold b\n\n## Not run, rejected or failed\n\n- x\n"


def test_a_collectives_run_writes_only_its_section(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(OLD)
    results = {"runs": [], "size": {}, "machine": {}, "mode": "quick"}
    assert report.sections_only(["collectives"]) and report.sections_only(["tiled"])
    report.update_sections(results, out, ["collectives"])
    section = "\n".join(tables_comm.collectives_section(results))
    assert section.startswith(tables_comm.HEADING) and "Not run in this report." in section
    assert out.read_text() == OLD.replace("## Not run", f"{section}\n\n## Not run")
    assert not (tmp_path / "plots").exists()  # no plot was redrawn
