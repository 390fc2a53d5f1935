"""What a ``Checkpointer`` is told at construction: retention, the default of ``background``
and the I/O options, as one frozen object built from the config (``from_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moezero.offload.options import IOOptions


@dataclass(frozen=True)
class CheckpointOptions:
    """Attributes:
        keep_last: Complete checkpoints kept under a root; older ones are removed on commit.
        background: Default of ``save(background=...)`` (``checkpoint.async``).
        verify_on_load: Check every range's crc32 while it is read, and every file's header
            against the manifest (``checkpoint.verify_on_load``).
        io: How the bytes reach the disk (O_DIRECT, flush, test delay) and the read chunk.
    """

    keep_last: int = 2
    background: bool = False
    verify_on_load: bool = True
    io: IOOptions = field(default_factory=IOOptions)

    @classmethod
    def from_config(cls, checkpoint, io: IOOptions | None = None) -> CheckpointOptions:
        """From the ``checkpoint`` config section and the engine's I/O options."""
        return cls(keep_last=checkpoint.keep_last, background=checkpoint.async_save,
                   verify_on_load=checkpoint.verify_on_load, io=io or IOOptions())
