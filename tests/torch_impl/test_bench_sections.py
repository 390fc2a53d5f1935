"""Benchmark plumbing of issue 19: a single-series run rewrites only its own BENCHMARKS.md
section (``benchmarks.fmt.splice``), and the GPU benchmark's code runs end to end on CPU
(``python -m benchmarks.gpu --smoke``, two of its rows)."""

from __future__ import annotations

from benchmarks import gpu, report
from benchmarks.fmt import splice

OLD = """# Benchmarks

## Results

old results

## Grouped-GEMM experts vs the per-expert loop (issue 19)

old grouped table

## Not run, rejected or failed

- nothing
"""


def test_splice_replaces_only_its_section():
    new = splice(OLD, ["## Grouped-GEMM experts vs the per-expert loop (issue 19)", "",
                              "new grouped table"])
    assert "old grouped table" not in new and "new grouped table" in new
    assert "old results" in new and new.index("new grouped table") < new.index("## Not run")
    assert new.count("## ") == OLD.count("## ")


def test_splice_inserts_a_missing_section_before_the_failures():
    new = splice(OLD, ["## GPU: x", "", "gpu rows"])
    assert new.index("old grouped table") < new.index("gpu rows") < new.index("## Not run")
    assert "old results" in new and "- nothing" in new


def test_update_sections_creates_a_missing_report(tmp_path):
    out = tmp_path / "B.md"
    report.update_sections({}, out, ["grouped"])
    assert out.read_text().startswith("# Benchmarks") and "## Grouped-GEMM" in out.read_text()


def test_only_self_contained_series_update_sections():
    assert report.sections_only(["grouped"])
    assert not report.sections_only([]) and not report.sections_only(["grouped", "main"])


def test_mfu_counts_active_parameters():
    m = {"vocab_size": 10, "dim": 4, "n_layers": 1, "n_heads": 1, "ffn_dim": 8,
         "num_experts": 3, "top_k": 2}
    assert gpu.active_params(m) == 10 * 4 + (4 * 16 + 3 * 4 + 2 * 3 * 4 * 8)
    assert gpu.flops_per_token(m, 5) == 6 * gpu.active_params(m) + 6 * 1 * 5 * 4
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe", None) == 756e12
    assert gpu.peak_flops("mystery", None) is None and gpu.peak_flops("mystery", 100) == 100e12


def test_gpu_benchmark_smoke_rows_run_on_cpu(tmp_path, capsys):
    code = gpu.main(["--smoke", "--work-dir", str(tmp_path), "--only", "per-expert loop",
                     "--only", "FSDP2", "--out", str(tmp_path / "never.md")])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "never.md").exists()
    assert out.count("| ok |") == 2, out


def test_the_estimate_section_judges_each_rank_against_its_estimate():
    """A row is met when every rank's peak is within ±25% of its own estimate."""
    from benchmarks.specs import SIZES, estimate_specs, overrides
    from benchmarks.tables_estimate import estimate_section
    from moezero.config import load_config
    from moezero.estimate import estimate

    spec = next(s for s in estimate_specs(SIZES["quick"]) if s["name"] == "stage 2")
    predicted = estimate(load_config(None, overrides(spec)), 2, rank=1, device="cpu").peak("cpu")
    runs = [{"spec": {**spec, "name": name}, "status": "ok",
             "ranks": [{"peak_rss": predicted}, {"peak_rss": factor * predicted}]}
            for name, factor in (("near", 1.1), ("far", 1.4))]
    machine = {"date": "today", "cpu": "cpu", "cores": 2, "torch": "2"}
    text = "\n".join(estimate_section({"runs": runs, "machine": machine}))
    near = next(ln for ln in text.splitlines() if ln.startswith("| near"))
    far = next(ln for ln in text.splitlines() if ln.startswith("| far"))
    assert "| 1.10 | met |" in near and "| 1.40 | missed (+40%) |" in far
    assert "Within ±25%: 1 of 2 configurations." in text
