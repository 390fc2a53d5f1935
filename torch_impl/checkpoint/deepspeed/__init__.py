"""``moezero import-deepspeed``: DeepSpeed ZeRO checkpoints (fp32 masters, Adam moments,
counters) into moezero's layout, read without executing pickled code
(docs/migrate-deepspeed.md)."""

from moezero.checkpoint.deepspeed import report
from moezero.checkpoint.deepspeed.importer import Report, import_deepspeed

__all__ = ["Report", "import_deepspeed", "report"]
