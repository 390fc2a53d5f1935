"""moezero.memory: host and device memory primitives below every other torch-side package.

``pinned`` (page-locked host buffers reused by size, private mappings, huge pages) serves both
``moezero.zero`` (host transfers, stage-3 storages) and ``moezero.offload`` (swap windows, the
GPUDirect fallback's staging); ``peak`` reads a process's peak memory for ``moezero.engine``'s
metrics and ``moezero.telemetry``. Living here, neither user imports the other for them
(docs/design.md, "Who imports whom").
"""
