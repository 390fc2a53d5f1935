"""What one training step allocates beyond the persistent state, by phase, for ``moezero estimate``.

Pure: sizes only, from the plan's partitions (``moezero.plan``) and the engine's own pure plans
(``zero.buckets``: reduction buckets, all-gather buckets, host-step windows). Each rule names
the code whose allocation it sizes. A rank's peak is its persistent state plus the runtime plus
the largest phase:

- ``backward``: the saved activations of one micro-batch (their upper bound: all of them are
  alive when backward starts), the gradient-reduction buffers (``zero.reduce``: two buckets'
  send buffers and outputs in flight, and on gloo its reduce-scatter's copies of both), at
  stages 2-3 the local gradients produced but not yet
  reduced (``param.grad`` is freed once its buckets are sent: with ``overlap_comm`` one
  bucket's worth plus the largest parameter, at stage 3 the largest unit, whose gradients
  arrive together; without it all of them), and at stage 3 the gathered units
  (``zero.gather``: the running unit, the prefetched one and its receive buffers, and the root
  unit held across the whole forward);
- ``step``: nothing for the tiled step (``zero.hostadam.adamw_step_`` upcasts each gradient
  as it reads it), every group's fp32 gradient when untiled (``zero.optimizer._upcast``); with
  offload the host step's windows (from a GPU, host copies of two windows' gradients in the
  compute dtype; with the NVMe gradient tier, two windows read from their swap files; with
  NVMe, three windows' swap buffers: ``offload.state.SwapState.stepping``);
- ``gather``: stages 1-2, the all-gather after the step (``zero.allgather.gather_all``: two
  buckets in flight, each a receive buffer unless it lands in place).

With ``offload_optimizer.step_in_forward`` the step runs beside the next forward, so the
step phase also holds that forward's activations and gathered units (backward's bounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moezero.config import Config
from moezero.offload.aio import aligned_size
from moezero.plan.partition import Partition
from moezero.zero.buckets import plan_gathers, plan_windows, scatter_columns
from moezero.zero.optimizer import ADAMW_TEMPORARIES
from moezero.zero.options import ZeroOptions

PHASES = ("backward", "step", "gather")
REDUCE_ITEMSIZE = {"fp32": 4, "bf16": 2}
IN_FLIGHT_BUCKETS = 2
"""Reduction buckets alive at once: the hooks launch a bucket as soon as its gradients are
ready and the waiter thread frees one when its collective is done; nothing bounds their number,
and two was what the ``estimate`` benchmark series measured (BENCHMARKS.md)."""
SWAP_WINDOWS = 3  # SwapState.stepping: one window read ahead, one stepped, one written behind


@dataclass(frozen=True)
class Transient:
    """Bytes alive for part of one phase of a training step."""

    phase: str  # one of PHASES
    what: str
    tier: str  # device | cpu (where it is allocated)
    bytes: int


@dataclass(frozen=True)
class StepShape:
    """What the transients depend on: this rank's groups and where things live."""

    parts: tuple[Partition, ...]  # this rank's groups, plan order
    kinds: tuple[str, ...]  # each group's data-parallel kind: dense, or moe/<group>/ep<rank>
    stage: int
    itemsize: int  # the compute dtype's
    compute: str  # the tier of the compute device: device, or cpu when training on the host
    host: bool  # training on the host (gloo)
    state: str  # the tier of the fp32 state in memory (and of the host step)
    nvme_optimizer: bool
    units: tuple[int, int]  # stage 3: bytes of the largest non-root unit and of the root unit
    straddle: int  # elements whose gradients arrive together: a param, at stage 3 a unit's


def transients(cfg: Config, shape: StepShape, activations: int) -> tuple[Transient, ...]:
    """Every transient of one step of ``cfg`` on this rank (zero-byte ones left out)."""
    zero = cfg.zero_optimization
    out = [Transient("backward", "activations (one micro-batch)", shape.compute, activations),
           *_backward(zero, shape)]
    if zero.offload_optimizer.device == "none":
        out += _tiled_step(zero.tiled_step, shape)
    else:
        out += _host_step(shape, ZeroOptions().host_window, zero.tiled_step)
    if shape.stage in (1, 2):
        out += _gather(zero.allgather_bucket_size, shape)
    if zero.steps_in_forward:  # the next forward runs beside the step
        out += [Transient("step", f"offload_optimizer.step_in_forward: the next forward's "
                          f"{t.what}", t.tier, t.bytes) for t in out
                if t.phase == "backward" and t.what.startswith(("activations", "gathered"))]
    return tuple(t for t in out + _budgets(zero, shape) if t.bytes)


def _budgets(zero, shape: StepShape) -> list[Transient]:
    """The stage-3/NVMe budgets (docs/offload.md), counted at their bytes (the config refuses
    them where they do nothing): units kept gathered on the compute device through backward;
    gradients kept and optimizer state read early in host buffers from backward into the
    step."""
    units = zero.offload_param.keep_for_backward
    held = (("offload_optimizer.keep_grads: reduced gradients kept in memory",
             zero.offload_optimizer.keep_grads),
            ("offload_optimizer.read_in_backward: optimizer state read early",
             zero.offload_optimizer.read_in_backward))
    return [Transient("backward", "offload_param.keep_for_backward: gathered units kept",
                      shape.compute, units),
            *(Transient(phase, what, shape.state, n) for what, n in held
              for phase in ("backward", "step"))]


def _backward(zero, shape: StepShape) -> list[Transient]:
    """Reduction buffers, gradients not yet reduced, gathered stage-3 units."""
    cap, dev = zero.reduce_bucket_size, shape.compute
    buckets = _reduce_buckets(shape, cap)
    scattered = shape.stage > 0  # reduce-scatter: an output of send / rows elements
    elems = sum(send + (send // dp if scattered and dp > 1 else 0) for send, dp in buckets)
    copies = sum(send + send // dp for send, dp in buckets if dp > 1) if scattered else 0
    itemsize = REDUCE_ITEMSIZE[zero.reduce_dtype]
    out = [Transient("backward", f"gradient reduction: {len(buckets)} bucket(s) in flight "
                     "(send buffers and outputs)", dev, elems * itemsize)]
    if shape.host:  # gloo's reduce-scatter copies its input and output
        out.append(Transient("backward", "gloo's copies of those buckets' input and output",
                             dev, copies * itemsize))
    if shape.stage >= 2:  # a bucket waits for all its params; a param read by two buckets
        local = sum(p.numel for p in shape.parts)  # is freed once the second one is sent
        waiting = min(local, cap + shape.straddle) if zero.overlap_comm else local
        out.append(Transient("backward", "local gradients not yet reduced", dev,
                             waiting * shape.itemsize))
    if shape.stage == 3:
        unit, root = shape.units
        out.append(Transient("backward", "gathered params: the root unit, the running unit, the "
                             "prefetched one and its receive buffers", dev, root + 3 * unit))
    return out


def _reduce_buckets(shape: StepShape, cap: int) -> list[tuple[int, int]]:
    """(send buffer elements, dp size) of the reduction buckets alive at once: the largest
    ``IN_FLIGHT_BUCKETS`` with a collective; a bucket of a one-rank kind is stored at once."""
    kinds: dict[str, list[int]] = {}  # kind -> [elements of its [rows, cols] matrices, dp]
    for p, kind in zip(shape.parts, shape.kinds, strict=True):
        entry = kinds.setdefault(kind, [0, p.dp_size])
        entry[0] += p.numel if shape.stage == 0 else p.padded_numel
    sizes = [(size, dp) for n, dp in kinds.values()
             for size in _cut(n, max(1, cap // (1 if shape.stage == 0 else dp))
                              * (1 if shape.stage == 0 else dp))]
    shared = sorted((s for s in sizes if s[1] > 1), reverse=True)[:IN_FLIGHT_BUCKETS]
    return shared or sorted(sizes, reverse=True)[:1]


def _cut(n: int, size: int) -> list[int]:
    """``n`` elements in buckets of ``size``: the buckets' sizes."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def _tiled_step(tiled: bool, shape: StepShape) -> list[Transient]:
    """The step where the state lives in memory beside the params. Tiled, each group's pass
    (``hostadam.adamw_step_``) upcasts its gradient as it reads it: no copy. Untiled, every
    group's gradient is upcast to fp32 first (``Optimizer._upcast``; stage 0 in fp32 steps it in
    place)."""
    elems = [p.numel if shape.stage == 0 else p.shard_numel for p in shape.parts]
    copies = shape.stage > 0 or shape.itemsize != 4
    grads = 0 if tiled else sum(elems) * 4 * copies
    return [Transient("step", "fp32 gradients of every group (untiled)", shape.state, grads),
            Transient("step", "AdamW temporaries of the largest group", shape.state,
                      ADAMW_TEMPORARIES * max(elems, default=0) * 4)]


def _host_step(shape: StepShape, window: int, tiled: bool) -> list[Transient]:
    """The offloaded step, window by window (``ZeroOptions.host_window`` elements): the
    gradients travel in the compute dtype (``Optimizer._stage``), two windows at a time; host
    copies only from a GPU; read from their swap files with the gradient tier
    (``zero.gradtier``). Untiled, every group's gradient is upcast to fp32 first."""
    shards = [p.shard_numel for p in shape.parts]
    sizes = [sum(shards[i] for i in w) for w in plan_windows(shards, window)]
    two = max((a + b for a, b in zip(sizes, sizes[1:] + [0], strict=True)), default=0)
    itemsize = shape.itemsize if tiled else 4
    out = [Transient("step", "fp32 gradients of every group (untiled)", shape.compute,
                     0 if tiled else sum(shards) * 4),
           Transient("step", "AdamW temporaries of one window", shape.state,
                     ADAMW_TEMPORARIES * max(sizes, default=0) * 4)]
    if shape.compute != shape.state:  # their host copies (pinned on CUDA)
        out.append(Transient("step", "host copies of two windows' gradients", shape.state,
                             two * itemsize))
    elif shape.nvme_optimizer and shape.stage == 3:  # gradtier.take: fresh read buffers
        out.append(Transient("step", "two windows' gradients read from their swap files",
                             shape.state, two * shape.itemsize))
    if shape.nvme_optimizer:
        three = max((sum(sizes[i:i + SWAP_WINDOWS]) for i in range(len(sizes))), default=0)
        out.append(Transient("step", "swap buffers of three windows (master, moments)",
                             shape.state, 3 * aligned_size(three * 4)))
    return out


def _gather(cap: int | None, shape: StepShape) -> list[Transient]:
    """The all-gather after the step: at most two buckets in flight."""
    cols = [scatter_columns(p) for p in shape.parts]
    keyed = [(i, "world" if kind == "dense" else f"edp{p.ep_size}", c)
             for i, (p, kind, c) in enumerate(zip(shape.parts, shape.kinds, cols, strict=True))]
    held = [_gather_held(b, cols, shape.itemsize) for b in plan_gathers(keyed, cap)]
    two = max((a + b for a, b in zip(held, held[1:] + [0], strict=True)), default=0)
    return [Transient("gather", "all-gather buffers of two buckets", shape.compute, two)]


def _gather_held(bucket, cols: Sequence, itemsize: int) -> int:
    """Bytes ``zero.allgather.launch`` allocates for one bucket."""
    if bucket.rows == 1:
        return 0
    send = bucket.cols * itemsize if len(bucket.pieces) > 1 else 0
    recv = 0 if bucket.whole(cols[bucket.pieces[0][0]]) else bucket.rows * bucket.cols * itemsize
    return send + recv


def activation_bytes(cfg: Config, itemsize: int) -> int:
    """Bytes of one micro-batch's activations on one rank at their peak, when backward starts:
    what the forward keeps (``kept_activation_bytes``) and, with activation checkpointing, the
    activations of the one checkpointed block being recomputed (``moezero.model.recompute``:
    blocks are recomputed one at a time, each just before its own backward); with
    ``model.loss_chunk_tokens``, plus one chunk of the head's logits (``head_chunk_bytes``)."""
    if not cfg.activation_checkpointing.enabled:
        return kept_activation_bytes(cfg, itemsize) + head_chunk_bytes(cfg, itemsize)
    recomputed = max(_block_bytes(cfg, itemsize, i) for i in _checkpointed(cfg))
    return kept_activation_bytes(cfg, itemsize) + _tokens(cfg) * recomputed \
        + _mask_bytes(cfg, itemsize) + head_chunk_bytes(cfg, itemsize)


def kept_activation_bytes(cfg: Config, itemsize: int) -> int:
    """Bytes one micro-batch's forward keeps for backward on one rank: per token, each block's
    activations (``_block_bytes``), or for a checkpointed block (blocks 0, n, 2n, ... with
    ``activation_checkpointing.every_n_layers`` n) only its D-wide input; then the head's:
    the final norm's fp32 input, the projection's input, the logits and the loss's fp32
    log-probabilities (with ``model.loss_chunk_tokens`` no logits: ``moezero.model.head``
    saves the projection's input and the targets, and makes each chunk's logits again in
    backward; measured in fp32); with a document mask each kept block's mask (``_mask_bytes``). Counted
    from the tensors autograd saves, fp32 and bf16, with and without grouped-query heads, a
    shared expert, checkpointing and a document mask (tests/torch_impl/test_estimate_peak.py,
    test_estimate_finetune.py)."""
    m = cfg.model
    checkpointed = len(_checkpointed(cfg))
    per_token = sum(_block_bytes(cfg, itemsize, i) for i in range(m.n_layers)
                    if i not in _checkpointed(cfg)) + checkpointed * m.dim * itemsize
    head = m.dim * (4 + itemsize) + m.vocab_size * (itemsize + 4)
    if m.loss_chunk_tokens:  # the final norm's input and output in fp32, its output, a target
        head = m.dim * (8 + itemsize) + 8
    masks = (m.n_layers - checkpointed) * _mask_bytes(cfg, itemsize) + _mask_bytes(cfg, 1)
    return _tokens(cfg) * (per_token + head) + masks


def head_chunk_bytes(cfg: Config, itemsize: int) -> int:
    """With ``model.loss_chunk_tokens``: one chunk's logits, their fp32 upcast and its
    log-probabilities, alive while the chunk's loss (or its gradient) is made."""
    chunk = min(cfg.model.loss_chunk_tokens or 0, _tokens(cfg))
    return chunk * cfg.model.vocab_size * (itemsize + 8)


def _mask_bytes(cfg: Config, itemsize: int) -> int:
    """A document mask [B, 1, S, S] of ``itemsize`` bytes (``data.document_mask: true``;
    ``moezero.model.packing``): the boolean one is kept once (itemsize 1), and each block's
    SDPA turns it into an additive mask in the compute dtype and keeps that for its backward
    (measured on CPU; CUDA's memory-efficient kernel takes the same additive mask: not
    measured). ``null`` (on for chat data) is not known from the config: set it explicitly."""
    if not cfg.data.document_mask:
        return 0
    return cfg.train.micro_batch_size * cfg.train.seq_len ** 2 * itemsize


def _tokens(cfg: Config) -> int:
    return cfg.train.micro_batch_size * cfg.train.seq_len


def _checkpointed(cfg: Config) -> range:
    """The blocks activation checkpointing recomputes: 0, n, 2n, ... (none when off)."""
    ac = cfg.activation_checkpointing
    return range(0, cfg.model.n_layers, ac.every_n_layers) if ac.enabled else range(0)


def _block_bytes(cfg: Config, itemsize: int, layer: int) -> int:
    """Bytes a decoder block's forward keeps per token: 6 D-wide tensors in fp32 whatever the
    compute dtype (each of the two norms keeps its fp32 input and normalised value, the router
    its fp32 input; the sixth covers the small ones: routing indices and weights, rotary
    tables, per-row statistics), the attention kind's (``_attention_bytes``: for ``gqa`` the
    queries, the attention's output and its reshaped copy, 3 H·K, the keys and values, 2 G·K:
    grouped-query heads are never expanded; the attention kernels, flash on GPUs and CPUs
    alike, keep only a log-sum-exp per head), the top-k rows
    into the experts (k D) and out of them in fp32 (k D), two of their SwiGLU hidden
    activations (2 k F) and three of the shared expert's (3 F_shared), the router's fp32 logits
    and probabilities (2 E). A dense layer (``model.first_k_dense``) keeps, after the same
    attention, its D-wide input and four of its SwiGLU's F-wide tensors (counted from the
    tensors autograd saves), with 5 D-wide fp32 tensors and no router's."""
    m, k = cfg.model, cfg.moe.top_k
    attention = _attention_bytes(cfg, itemsize) if layer not in m.gated_delta_layers else \
        _gated_delta_bytes(m)
    if layer < m.first_k_dense:
        return attention + itemsize * (m.dim + 4 * (m.dense_ffn_dim or m.ffn_dim)) + 4 * 5 * m.dim
    widths = k * m.dim + 2 * k * m.ffn_dim + 3 * cfg.moe.shared_ffn_dim
    return attention + itemsize * widths + 4 * ((6 + k) * m.dim + 2 * cfg.moe.num_experts)


def _attention_bytes(cfg: Config, itemsize: int) -> int:
    """Bytes the attention kind keeps per token (``model.attention``). ``gqa``: 3 H·K + 2 G·K
    (``_block_bytes``). ``mla`` (``moezero.model.mla``): per latent RMSNorm (width n) its
    fp32 input, normalised value and row statistic plus its output, (8 + itemsize)·n + 4,
    where in fp32 the key/value norm's input is the whole kv_a_proj_with_mqa output (C + R
    wide); then, W = max(Q, V), the queries, keys and output of W per head (3 H·W: the fused
    kernel keeps no S×S weights) and the kernel's fp32 log-sum-exp per head; with V < Q the
    zero-padded values (H·W) and the output's cut copy for o_proj (H·V), else the values'
    kv_b_proj output (H·(N + V)) and no copy. Counted from the tensors autograd saves
    (tests/torch_impl/test_mla_estimate.py)."""
    m = cfg.model
    if m.attention != "mla":
        head = m.head_dim or m.dim // m.n_heads
        return itemsize * ((3 + 2 * m.attn_output_gate) * m.n_heads * head
                           + 2 * (m.n_kv_heads or m.n_heads) * head)
    c, r, h = m.kv_lora_rank, m.qk_rope_head_dim, m.n_heads
    wide = max(m.qk_nope_head_dim + r, m.v_head_dim)
    latents = [c] + ([m.q_lora_rank] if m.q_lora_rank else [])
    norms = sum((8 + itemsize) * n + 4 for n in latents) + (4 * r if itemsize == 4 else 0)
    values = wide + m.v_head_dim if m.v_head_dim < wide else m.qk_nope_head_dim + m.v_head_dim
    return norms + itemsize * h * (3 * wide + values) + 4 * h


def _gated_delta_bytes(m) -> int:
    """Bytes a gated DeltaNet layer (``model.gated_delta_layers``) keeps per token, counted at
    fp32 (the rule computes in fp32): its conv's input and W - 1 shifted copies and output
    (C·(W+1), C = 2GK + HV), the normalised and repeated q and k and their intermediates
    (4GK + 10HK), v, z and the gated norm's tensors (10HV), the chunked rule's C×C tiles
    (decay, triangular system, local attention: 4.5 H·chunk per token) and the [K, V] state
    per head carried into each chunk (HKV/chunk). Fitted to the tensors autograd saves
    (within 5% over chunk, head and window sizes; tests/torch_impl/test_estimate_peak.py)."""
    g, h = m.linear_num_key_heads, m.linear_num_value_heads
    kd, vd, c = m.linear_key_head_dim, m.linear_value_head_dim, m.gated_delta_chunk
    channels = 2 * g * kd + h * vd
    floats = channels * (m.linear_conv_kernel_dim + 1) + 4 * g * kd + 10 * h * (kd + vd) \
        + 9 * h * c / 2 + h * kd * vd / c
    return int(4 * floats)
