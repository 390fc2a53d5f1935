"""The benchmark check (``benchmarks/check.py``, issue 28 item 0) on small report texts: a
failed or missing peer row and a peak-anon ratio worse by more than 10% fail it; the same or
better figures pass. No benchmark runs (milliseconds)."""

from __future__ import annotations

import pytest

from benchmarks import check


def report(ds_status: str = "ok", anon: tuple[str, str] = ("0.69×", "0.55×")) -> str:
    """A report with the results and ratios tables' shape (cells cut to what the check reads);
    like ``benchmarks.report``, no ratio row for a peer that did not run ``ok``."""
    ds_ratio = (f"| moezero stage 2 | DeepSpeed ZeRO-2 | 1.86× | {anon[1]} | 0.65× | 0.75× |\n"
                if ds_status == "ok" else "")
    return f"""# Benchmarks

## Results (median over rounds)

| configuration | status | tokens/s per rank | peak anon per rank |
| --- | --- | --- | --- |
| moezero stage 2 | ok | 6,006 (5,582–6,429) | 207 MiB |
| FSDP2 + DCP | ok | 2,818 (2,650–2,986) | 299 MiB |
| DeepSpeed ZeRO-2 | {ds_status} | – | – |

- notes

## Ratios (moezero / peer)

| moezero | peer | tokens/s | peak anon | peak RSS | checkpoint bytes |
| --- | --- | --- | --- | --- | --- |
| moezero stage 2 | FSDP2 + DCP | 2.13× | {anon[0]} | 0.78× | 0.96× |
{ds_ratio}
Throughput above 1× is better.
"""


def test_the_tables_are_read():
    text = report()
    assert check.row_status(text)["DeepSpeed ZeRO-2"] == "ok"
    assert check.anon_ratios(text) == {("moezero stage 2", "FSDP2 + DCP"): 0.69,
                                       ("moezero stage 2", "DeepSpeed ZeRO-2"): 0.55}


@pytest.mark.parametrize("anon", [("0.69×", "0.55×"), ("0.60×", "0.50×"), ("0.75×", "0.60×")])
def test_same_better_or_within_10_percent_passes(anon):
    assert check.failures(report(), report(anon=anon)) == []


def test_a_failed_peer_row_fails():
    new = report(ds_status="failed: ModuleNotFoundError: No module named 'moezero'")
    lines = check.failures(report(), new)
    assert len(lines) == 2  # the row, and its ratio gone from the ratios table
    assert lines[0] == ("peer row 'DeepSpeed ZeRO-2': failed: ModuleNotFoundError: "
                        "No module named 'moezero'")
    assert lines[1].startswith("peak anon moezero stage 2 / DeepSpeed ZeRO-2: no ratio")


def test_a_missing_peer_row_fails():
    new = report().replace("| DeepSpeed ZeRO-2 | ok | – | – |\n", "")
    assert check.failures(report(), new) == [
        "peer row 'DeepSpeed ZeRO-2': missing from the results table"]


def test_a_ratio_worse_by_more_than_10_percent_fails():
    lines = check.failures(report(), report(anon=("0.89×", "0.60×")))
    assert lines == [
        "peak anon moezero stage 2 / FSDP2 + DCP: 0.89×, worse than the committed 0.69× "
        "by more than 10%"]


def test_main_exits_1_with_a_line_per_failure(tmp_path, capsys):
    old, new = tmp_path / "old.md", tmp_path / "new.md"
    old.write_text(report())
    new.write_text(report(ds_status="failed: boom", anon=("0.89×", "0.55×")))
    assert check.main([str(old), str(new)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("benchmark check: ") for line in err)
    new.write_text(report())
    assert check.main([str(old), str(new)]) == 0
