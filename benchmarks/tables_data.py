"""The ``data`` series' section of ``BENCHMARKS.md`` (``benchmarks.data_prep``), and splicing
one section into an existing report so that running one series rewrites only its section."""

from __future__ import annotations

import re

from benchmarks.fmt import table, verdict

HEADING = "## prepare-data against the tokenizer's own batch encoding (issue 17)"
TARGET = 0.8


def data_section(results: dict) -> list[str]:
    """The section's lines from ``results["data_prep"]`` (a note when absent or failed)."""
    data = results.get("data_prep")
    lines = [HEADING, ""]
    if data is None:
        return lines + ["Not run (`nox -s bench -- --series data`)."]
    if "error" in data or "error" in data.get("prepare", {}):
        return lines + [f"Failed: {data.get('error') or data['prepare']['error']}"]
    corpus, floor, prep = data["corpus"], data["floor"], data["prepare"]
    mb = corpus["bytes"] / 1e6
    share = floor["seconds"] / prep["seconds"]
    rows = [[f"`tokenizers` `{floor['method']}` (the floor: text already in memory, "
             f"{2000:,}-document batches)", f"{floor['seconds']:.1f}", f"{mb / floor['seconds']:.2f}",
             f"{floor['tokens'] / floor['seconds']:,.0f}", "100%"],
            [f"`moezero prepare-data` (fresh process: read + parse jsonl, "
             f"{data['workers']} worker processes, {prep['shards']} shards, index, manifest)",
             f"{prep['seconds']:.1f}", f"{mb / prep['seconds']:.2f}",
             f"{prep['tokens'] / prep['seconds']:,.0f}", f"{100 * share:.0f}%"]]
    one = data.get("one_thread") or {}
    if "seconds" in one:
        ideal = one["seconds"] / data["workers"]
        rows.append([f"reference: the same on one thread × {data['workers']} cores (perfect "
                     "scaling; not a measured run)", f"{ideal:.1f}", f"{mb / ideal:.2f}",
                     f"{one['tokens'] / ideal:,.0f}", f"{100 * floor['seconds'] / ideal:.0f}%"])
    machine = results.get("machine", {})
    return lines + [
        f"Run {machine.get('date', '?')} on {machine.get('cores', '?')} cores: `"
        f"{results.get('command', '?')}`. Generated jsonl corpus of {mb:,.1f} MB, "
        f"{corpus['documents']:,} documents (Zipf-distributed pseudo-words); byte-level BPE of "
        "8,192 tokens trained with `tokenizers` on its first 2,000 documents. Both runs encode "
        "the same documents in the same run; prepare-data also appends one end-of-document "
        f"token per document ({prep['tokens']:,} tokens against {floor['tokens']:,}).", "",
        *table(["run", "seconds", "MB/s of text", "tokens/s", "throughput vs the floor"], rows),
        "", *table(["target", "measured", "status"],
                   [["prepare-data ≥ 80% of the tokenizer's own batch encoding",
                     f"{100 * share:.0f}%", verdict(share, TARGET, ">=")]]),
        "", "The floor is the tokenizer's batch call as shipped (its Rust thread pool over "
        "every core); prepare-data runs one worker process per core, each tokenizing on one "
        "thread, so it can exceed the floor where the thread pool scales worse than processes "
        "(compare the one-thread reference row). The corpus, tokenizer and prepared dataset "
        "are deleted after the run."]


def existing_section(text: str, heading: str = HEADING) -> list[str] | None:
    """The section ``heading`` (default: the data section) of an existing report, as lines
    (None when it has none)."""
    found = re.search(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", text, re.S | re.M)
    return found.group(0).rstrip("\n").split("\n") if found else None
