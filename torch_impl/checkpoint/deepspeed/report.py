"""The lines ``moezero import-deepspeed`` prints: the source layout, what was found, bytes in
and out (the measured size ratio), and what was not carried over."""

from __future__ import annotations

from moezero.checkpoint.deepspeed import pickles
from moezero.checkpoint.deepspeed.importer import Report


def render(report: Report, out: str) -> str:
    src = report.source
    lines = [
        f"source: {src.folder} (DeepSpeed {src.ds_version}): ZeRO stage {src.stage}, "
        f"data-parallel world size {src.world_size}, ep {'/'.join(map(str, report.eps))}, "
        f"module dtype {src.dtype}, "
        f"{report.numel:,} parameters in {len(src.groups)} optimizer group(s)",
        f"found: {', '.join(report.found)}; global step {src.global_steps}",
        f"bytes: {report.bytes_in:,} in ({len(src.optim_files)} optimizer file(s)), "
        f"{report.bytes_out:,} out: {report.bytes_in / max(report.bytes_out, 1):.2f}x",
        *_experts(report),
        *(f"not carried over: {note}" for note in report.notes),
        f"wrote {report.step_dir}",
        f"continue: moezero train --config {out}/config.yaml (DeepSpeed's optimizer settings "
        "and checkpoint.load; --set checkpoint.load alone adopts only the architecture)",
    ]
    return "\n".join(lines)


def _experts(report: Report) -> list[str]:
    """The per-expert files' size against the tensor bytes they hold (measured: DeepSpeed
    versions that pickle views of one flat buffer store the whole buffer in each file)."""
    files = report.source.expert_files
    if not files:
        return []
    size = sum(p.stat().st_size for p in files)
    held = sum(t.numel() * t.element_size() for p in files for t in pickles.load(p).values()
               if hasattr(t, "numel"))
    return [f"expert files: {len(files)}, {size:,} bytes holding {held:,} bytes of tensors "
            f"({size / max(held, 1):.2f}x; their weights are not read: the optimizer files "
            "hold the fp32 masters)"]
