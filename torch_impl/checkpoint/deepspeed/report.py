"""The lines ``moezero import-deepspeed`` prints: the source layout, what was found, bytes in
and out (the measured size ratio), and what was not carried over."""

from __future__ import annotations

from moezero.checkpoint.deepspeed.importer import Report


def render(report: Report, out: str) -> str:
    src = report.source
    lines = [
        f"source: {src.folder} (DeepSpeed {src.ds_version}): ZeRO stage {src.stage}, "
        f"data-parallel world size {src.world_size}, ep 1, module dtype {src.dtype}, "
        f"{src.numel:,} parameters in {len(src.groups)} optimizer group(s)",
        f"found: {', '.join(report.found)}; global step {src.global_steps}",
        f"bytes: {report.bytes_in:,} in ({len(src.optim_files)} optimizer file(s)), "
        f"{report.bytes_out:,} out: {report.bytes_in / max(report.bytes_out, 1):.2f}x",
        *(f"not carried over: {note}" for note in report.notes),
        f"wrote {report.step_dir}",
        f"continue: moezero train --set checkpoint.load={out} "
        f"(or --config {out}/config.yaml)",
    ]
    return "\n".join(lines)
