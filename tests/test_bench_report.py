"""benchmarks/report.py: a run of the ``collectives`` series alone rewrites only its own section
of an existing BENCHMARKS.md (``report.update_sections``), leaving every other byte."""

from __future__ import annotations

from benchmarks import nvme_phases, report, tables_comm, tables_scale
from benchmarks.scale import read_peer
from benchmarks.specs import SCALE_SIZES
from benchmarks.stats import param_count

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


def _scale_results(peer: dict) -> dict:
    def rank(step_s: float) -> dict:
        step = {"s": step_s, "loss": 5.5, "swap": 2e9, "read": 1e9, "write": 0.5e9}
        return {"status": "ok", "peak_rss": 2 * 2**30, "anon_peak": 2**30, "init_s": 30.0,
                "steps": [step] * 3, "save_s": 40.0, "load_s": 20.0, "ckpt_bytes": 24e9,
                "resumed": {**step, "loss": 5.4},
                "phase_rss": {"init": 2**29, "train": 2 * 2**30}}

    dd = {"read": 1e9, "write": 0.5e9, "write_buffered": 0.4e9}
    return {"machine": {"date": "d", "cpu": "c", "cores": 2, "mem_bytes": 24 * 2**30,
                        "torch": "t"}, "mode": "full", "size": SCALE_SIZES["full"],
            "dd_before": dd, "dd_after": dd, "peer": peer,
            "run": {"status": "ok", "ranks": [rank(6.0), rank(5.0)]}}


def test_scale_section_ratio_peer_row_and_only_its_section(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(OLD)
    results = _scale_results({"ok": False, "error": "not run (no --peer-json given)"})
    report.update_sections(results, out, ["scale"])
    section = tables_scale.scale_section(results)
    assert out.read_text() == OLD.replace("## Not run", "\n".join(section) + "\n\n## Not run")
    text = "\n".join(section)
    # both ranks: 2 GB read at 1 GB/s + 1 GB written at 0.5 GB/s = 4 s; the slower rank's 6 s
    assert "| 6.0 s | 2.0 / 1.0 GB | 1.50× |" in text and "1.50× (met" in text
    assert "2.05 B" in text and "2.00 GiB" in text and "(met, target ≤ 3 GiB)" in text
    assert "| DeepSpeed (peer) | – | not run (no --peer-json given) |" in text
    assert "init 0.50 GiB, train 2.00 GiB." in text
    peer = {"ok": True, "params": 2.05e9, "peak_rss_bytes": 5 * 2**30, "peak_anon_bytes": None,
            "init_s": 60.0, "step_s": 90.0, "swap_bytes": 3e10}
    text = "\n".join(tables_scale.scale_section(_scale_results(peer)))
    assert "| DeepSpeed (peer) | 2.05 B | 5.00 GiB | – | 60 s | 90.0 s | (its swap files: 30.0 GB) | – |" in text
    stopped = {"ok": False, "error": "rank 1: exceeded 8.0 GiB RSS", "params": 2.12e9,
               "peak_rss_bytes": [None, 8 * 2**30], "init_s": 224.0, "step_s": [],
               "swap_bytes": 2.5e10}
    text = "\n".join(tables_scale.scale_section(_scale_results(stopped)))
    assert ("| DeepSpeed (peer) | 2.12 B | 8.00 GiB | – | 224 s | – | (its swap files: 25.0 GB) | stopped: rank 1: "
            "exceeded 8.0 GiB RSS |") in text


def test_scale_section_of_a_missing_peer_file(tmp_path):
    assert read_peer(None)["error"].startswith("not run")
    assert read_peer(str(tmp_path / "absent.json"))["error"].startswith("not run (")


def _phased(s: float, wait: float) -> dict:
    zero = {f"{t}_{op}": 0 for t in ("param", "grad", "optim") for op in ("read", "write")}
    forward = {**zero, "s": s, "param_read": 1e9, "param_wait_s": wait}
    step = {**zero, "s": 2 * s, "grad_read": 0.5e9, "optim_read": 1.5e9, "optim_write": 1.5e9,
            "optim_wait_s": wait, "grad_wait_s": wait}
    return {"forward": forward, "backward": {**zero, "s": s}, "reduce": {**zero, "s": 0.0},
            "step": step}


def test_nvme_and_scale_sections_split_the_step_by_phase():
    """Per phase: the slower rank's seconds and main-thread waits, both ranks' bytes; swap
    bytes per parameter (a cheap render of hand-made figures, no run)."""
    results = _scale_results({})
    for r, (s, wait) in zip(results["run"]["ranks"], [(1.0, 0.25), (2.0, 0.5)], strict=True):
        r["steps"] = [{**r["steps"][0], "phases": _phased(s, wait)}] * 3
    text = "\n".join(tables_scale.scale_section(results))
    assert "| moezero | forward | 2.00 | 0.50 | 1.50 | 2.00 | 0.00 | 0.00 | 0.00 / 0.00 |" in text
    assert "| moezero | step | 4.00 | 1.00 | 3.00 | 0.00 | 0.00 | 1.00 | 3.00 / 3.00 |" in text
    params = param_count(SCALE_SIZES["full"]["model"])
    assert f"4.0 GB ({4e9 / params:.1f} B per parameter)" in text  # 2 GB per rank
    nvme = {**results, "runs": {"today": [results["run"]]}, "size": SCALE_SIZES["quick"]}
    text = "\n".join(nvme_phases.nvme_section(nvme))
    per_param = 4e9 / param_count(SCALE_SIZES["quick"]["model"])
    assert f"| today | 6.0 s | 1.00× | 4.0 s | 1.50× | 4.00 GB | {per_param:.1f} B |" in text
    assert "| today | step | 4.00 | 1.00 | 3.00 |" in text


def test_the_main_series_keeps_every_section_of_a_run_of_its_own(tmp_path, monkeypatch):
    """A run of the main series rewrites its own sections and keeps those other harnesses
    wrote (bigbase, finetune, GPU, ...): the bigbase section was dropped by the first
    ``--quick`` run after it landed."""
    from benchmarks import bigbase_report, finetune_families, gpu, gpu_check

    own = [bigbase_report.TITLE, finetune_families.SECTION, gpu.SECTION, gpu_check.SECTION,
           report.HOSTSTEP_HEADING]
    out = tmp_path / "BENCHMARKS.md"
    out.write_text(OLD.replace("## Not run", "".join(f"{h}\n\nkept\n\n" for h in own)
                               + "## Not run"))
    monkeypatch.setattr(report, "render", lambda results, links: OLD)
    monkeypatch.setattr(report.plots, "memory_vs_experts", lambda results, path: None)
    monkeypatch.setattr(report.plots, "throughput", lambda results, path: None)
    text = report.write({"runs": []}, out, tmp_path / "plots")
    for heading in own:
        assert f"{heading}\n\nkept" in text, heading


def test_bigbase_section_counts_the_resume_row_in_its_targets():
    from benchmarks import bigbase_report

    def run(steps: list[float], rss: int) -> dict:
        rank = {"steps": [{"step_s": s, "read_bytes": 2**30, "loss": 1.0} for s in steps],
                "peak_rss": rss, "anon_peak": rss // 2, "checkpoint_bytes": 2**20}
        return {"status": "ok", "ranks": [rank, rank], "watch": {"peak_tree": 2**30}}

    size = {"model": {"n_layers": 24, "num_experts": 128, "top_k": 8}, "compute_layers": 2,
            "dd_mib": 64, "seq_len": 1024, "dtype": "bf16"}
    res = {"inputs": {"params": 16e9, "hf_bytes": 30 * 2**30, "base_bytes": 30 * 2**30,
                      "write_s": 1.0, "import_s": 2.0},
           "size": size, "disk": [{"read": 2**30, "write": 2**30}], "uptime": [],
           "runs": {"in place": run([110.0, 100.0], 2 * 2**30), "resume": run([90.0], 4 * 2**30),
                    "compute": run([9.0, 8.0], 2**30)}}
    text = "\n".join(bigbase_report.table({"command": "c", "bigbase": res}))
    # compute: the steady step 8 s x 24 / 2 = 96 s; disk: 2 GiB over 1 GiB/s = 2 s
    assert "| resumed | 1.00 / 1.00 GiB | 2 s | 96 s | 90 s | 0.94 |" in text
    assert "| resume | 1 | 4,096 MiB |" in text
    assert "peak RSS ≤ 3 GiB per rank: not met (4.00 GiB)" in text  # the resume's peak counts
    assert "step ≤ 1.2x max(disk, compute): met (worst 1.15x)" in text
