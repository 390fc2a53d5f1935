"""One model config, both sides: the torch decoder and the reference params with equal weights.

Weights move torch → JAX by FQN (``moezero.reference.weights.from_fqn_dict``); init is torch's
``init_weights`` (init need not match across sides, docs/model.md). The JAX functions are
jitted once at import, keyed by their static config, so each config compiles once per session.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from moezero.config import Config
from moezero.data import Batches, make_corpus
from moezero.distributed.topology import build_topology
from moezero.engine import initialize
from moezero.model.build import build_decoder
from moezero.model.decoder import Decoder, ModelArgs
from moezero.model.lora import LoraOptions
from moezero.model.materialize import KeyedInit
from moezero.plan.model_buffers import is_buffer
from moezero.reference.model import ModelConfig, forward, loss_fn, oracle_loss
from moezero.reference.optim import OptimConfig, train_step
from moezero.reference.weights import from_fqn_dict
from tests.support.compare import jax_fqns, to_numpy, torch_fqns

SEQ = 16  # tokens per sequence
BATCH = 2  # sequences per batch (per rank in distributed tests)

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=48, num_experts=4,
                   top_k=2)


def tiny(**changes) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)


# Every decoder / router option of the Hugging Face families (docs/model.md) and every layer
# kind (the dense MLP of first-k-dense models), each in at least one config (paired where independent, to compile fewer reference programs).
OPTIONS = {
    "gqa-qk-norm-head-partial-rotary": tiny(n_heads=4, n_kv_heads=2, qk_norm="head",
                                            partial_rotary_factor=0.5),
    "mqa-head-dim-qk-norm-projection": tiny(n_heads=4, n_kv_heads=1, head_dim=12,
                                            qk_norm="projection"),
    "bias-qkv-shared-gated": tiny(attn_bias="qkv", shared_ffn_dim=24, shared_gate=True),
    "bias-all-shared": tiny(attn_bias="all", shared_ffn_dim=24),
    "sigmoid-expert-bias": tiny(router_scoring="sigmoid", expert_bias=True),
    "softmax-expert-bias-no-renorm": tiny(expert_bias=True, renormalize=False),
    "first-k-dense": tiny(n_layers=3, first_k_dense=1, dense_ffn_dim=40),
    # gpt-oss (issue 36): sinks, alternating windows shorter than SEQ, YaRN, the router's bias
    # and top-k-then-softmax, expert biases, a clamp low enough to bite at this init
    "gpt-oss": tiny(n_heads=4, n_kv_heads=2, attn_bias="all", attn_sinks=True, sliding_window=5,
                    layer_types=("sliding_attention", "full_attention"), rope_type="yarn",
                    rope_factor=4.0, rope_original_max_positions=8, rope_truncate=False,
                    router_scoring="topk_softmax", router_bias=True, expert_mlp_bias=True,
                    swiglu_limit=0.1, swiglu_alpha=1.5),
    "window-yarn-mscale": tiny(sliding_window=3, rope_type="yarn", rope_factor=8.0,
                               rope_original_max_positions=4, rope_mscale=0.8,
                               rope_mscale_all_dim=0.5),
    # multi-head latent attention (model/mla.py): a query latent, interleaved RoPE dims,
    # biases, YaRN (frequencies, cos/sin factor, softmax factor); a plain q_proj with half-split RoPE dims
    "mla-q-lora-interleave-bias": tiny(attention="mla", q_lora_rank=12, kv_lora_rank=8,
                                       qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
                                       attn_bias="all", mla_mscale=1.2, rope_type="yarn",
                                       rope_factor=4.0, rope_original_max_positions=4,
                                       rope_mscale=0.8, rope_mscale_all_dim=0.6),
    "mla-plain-q-halves": tiny(attention="mla", kv_lora_rank=8, qk_nope_head_dim=6,
                               qk_rope_head_dim=4, v_head_dim=5, rope_interleave=False),
    # DeepSeek-V3's routing: sigmoid + expert bias, group-limited top-k, scaled gates
    "sigmoid-groups-scaled": tiny(num_experts=8, top_k=3, router_scoring="sigmoid",
                                  expert_bias=True, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, shared_ffn_dim=48),
    # Qwen3-Next: gated DeltaNet in layers 0 and 2 (chunks of 5: SEQ is no multiple), gated
    # attention with QK-norm and partial rotary in layer 1, the gated shared expert
    "qwen3-next-hybrid": tiny(n_layers=3, n_heads=4, n_kv_heads=2, qk_norm="head",
                              partial_rotary_factor=0.5, attn_output_gate=True,
                              gated_delta_layers=(0, 2), linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=8,
                              linear_value_head_dim=6, linear_conv_kernel_dim=3,
                              gated_delta_chunk=5, shared_ffn_dim=24, shared_gate=True),
}


def perturb(model: Decoder, seed: int) -> Decoder:
    """Norm gains 1 + N(0, 0.1²), biases N(0, 0.1²), expert biases N(0, 0.05²): so every
    option's tensors take part in the forward (their init is 1 or 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for fqn, t in model.state_dict(keep_vars=True).items():
            if is_buffer(fqn):
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif t.ndim == 1:
                t.add_(0.1 * torch.randn(t.shape, generator=gen))
    return model


REFERENCE_ONLY = {"lora_r", "lora_scale", "lora_targets"}
"""``ModelConfig`` fields that are not ``ModelArgs``': torch's LoRA is the ``peft`` section
(``torch_lora``, ``moezero.model.lora.apply_lora`` on a built model)."""


def torch_lora(cfg: ModelConfig) -> LoraOptions | None:
    """The torch ``LoraOptions`` of a reference config's ``lora_*`` fields (None: no LoRA)."""
    if not cfg.lora_r:
        return None
    return LoraOptions(cfg.lora_r, cfg.lora_scale * cfg.lora_r, 0.0, cfg.lora_targets)


def torch_args(cfg: ModelConfig, ep_size: int = 1) -> ModelArgs:
    """The torch ``ModelArgs`` of a reference ``ModelConfig`` (same field names)."""
    ref_names = {f.name for f in dataclasses.fields(ModelConfig)} - REFERENCE_ONLY
    names = {f.name for f in dataclasses.fields(ModelArgs)} & ref_names
    assert names == ref_names, f"ModelArgs lacks {sorted(ref_names - names)}"
    return ModelArgs(**{n: getattr(cfg, n) for n in names}, ep_size=ep_size)


def torch_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """An fp32 torch decoder (all experts local) with ``init_weights(seed)``."""
    return build_decoder(torch_args(cfg), where="cpu", lora=torch_lora(cfg), init=KeyedInit(seed))


def to_jax(model_or_fqns, cfg: ModelConfig) -> dict:
    """Reference params holding exactly the torch weights and buffers (fp32)."""
    flat = model_or_fqns if isinstance(model_or_fqns, dict) else \
        torch_fqns(model_or_fqns.state_dict())
    return from_fqn_dict({k: np.asarray(v, np.float32) for k, v in flat.items()}, cfg)


def tokens(seed: int, batch: int = BATCH, seq: int = SEQ + 1, vocab: int = TINY.vocab_size):
    """Random token ids [batch, seq] as int64 numpy (torch indexes with int64)."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int64)


@functools.cache
def _batches(global_batch: int, seed: int) -> Batches:
    corpus = make_corpus(None, vocab=32, sources=2, seed=7)
    return Batches(corpus, global_batch=global_batch, seq_len=SEQ, seed=seed, dp_rank=0,
                   dp_size=1)


def corpus_batch(step: int, batch: int = BATCH, seed: int = 0) -> np.ndarray:
    """Global batch ``step`` [batch, SEQ+1] of the synthetic Markov corpus (learnable data)."""
    return _batches(batch, seed).global_batch_at(step)


# ------------------------------------------------------------------ jitted reference functions

def _loss_grads_logits(params, batch, cfg, dtype):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, cfg,
                                                                       dtype=dtype)
    logits, _ = forward(params, batch[:, :-1], cfg, dtype=dtype)
    return loss, metrics, grads, logits


def _oracle_and_grads(params, batch, cfg, world_size):
    return jax.value_and_grad(oracle_loss, has_aux=True)(params, batch, cfg, world_size)


jit_loss_grads_logits = jax.jit(_loss_grads_logits, static_argnames=("cfg", "dtype"))
jit_oracle_and_grads = jax.jit(_oracle_and_grads, static_argnames=("cfg", "world_size"))


class Run(NamedTuple):
    """One forward + backward of one side, as numpy: the loss, logits and grads by FQN."""

    loss: float
    ce: float
    logits: np.ndarray
    grads: dict[str, np.ndarray]


def jax_run(params, batch, cfg: ModelConfig, dtype=jnp.float32) -> Run:
    """``moezero.reference.model.loss_fn`` and its grads, and ``forward``'s logits, on one batch."""
    loss, metrics, grads, logits = jit_loss_grads_logits(
        params, jnp.asarray(batch, jnp.int32), cfg, jnp.dtype(dtype))
    grads = {k: v for k, v in jax_fqns(grads).items() if not is_buffer(k)}  # no gradient
    return Run(float(loss), float(metrics["ce"]), to_numpy(logits), grads)


def torch_run(model: Decoder, batch) -> Run:
    """``Decoder.loss`` and its grads (zeroed first), and the logits, on one batch."""
    model.zero_grad(set_to_none=True)
    tokens_BS1 = torch.as_tensor(batch)
    loss, metrics = model.loss(tokens_BS1)
    loss.backward()
    with torch.no_grad():
        logits, _ = model(tokens_BS1[:, :-1])
    return Run(loss.item(), metrics["ce"].item(), to_numpy(logits), torch_fqns(model, grads=True))


# ------------------------------------------------------------------------------ torch engine


GPT_OSS_KEYS = {  # issue 36's gpt-oss fields, by config section
    "model": ("attn_sinks", "sliding_window", "layer_types", "rope_type", "rope_factor",
              "rope_original_max_positions", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
              "rope_attention_factor", "rope_mscale", "rope_mscale_all_dim"),
    "moe": ("router_bias", "expert_mlp_bias", "swiglu_limit", "swiglu_alpha")}
MLA_KEYS = ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "rope_interleave", "mla_mscale")
QWEN3_NEXT_KEYS = ("gated_delta_layers", "linear_num_key_heads", "linear_num_value_heads",
                   "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                   "gated_delta_chunk", "attn_output_gate")


def engine_config(cfg: ModelConfig, opt: OptimConfig, *, precision: str = "fp32",
                  ep_size: int = 1, stage: int = 0) -> Config:
    """The torch ``Config`` of a reference (model, optimizer) pair: same keys, same values.

    ``optimizer.total_steps`` is the engine's ``train.steps`` (where the cosine ends).
    """
    c = Config()
    c.model = c.model.model_copy(update={
        k: getattr(cfg, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim",
                                     "rope_theta", "norm_eps", "n_kv_heads", "head_dim",
                                     "qk_norm", "attn_bias", "first_k_dense",
                                     "dense_ffn_dim", "partial_rotary_factor", *MLA_KEYS,
                                     *QWEN3_NEXT_KEYS)})
    c.moe = c.moe.model_copy(update={
        "num_experts": cfg.num_experts, "top_k": cfg.top_k, "ep_size": ep_size,
        "capacity_factor": cfg.capacity_factor, "aux_loss_coef": cfg.aux_loss_coef,
        "z_loss_coef": cfg.z_loss_coef,
        **{k: getattr(cfg, k) for k in ("router_scoring", "renormalize", "expert_bias",
                                        "bias_update_rate", "shared_ffn_dim", "shared_gate",
                                        "n_group", "topk_group", "routed_scaling_factor")}})
    c.model = c.model.model_copy(update={k: getattr(cfg, k) for k in GPT_OSS_KEYS["model"]})
    c.moe = c.moe.model_copy(update={k: getattr(cfg, k) for k in GPT_OSS_KEYS["moe"]})
    c.optimizer = c.optimizer.model_copy(update={
        "lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay,
        "gradient_clipping": opt.gradient_clipping, "warmup_steps": opt.warmup_steps,
        "min_lr_ratio": opt.min_lr_ratio})
    c.train = c.train.model_copy(update={"steps": opt.total_steps, "seq_len": SEQ,
                                         "micro_batch_size": BATCH})
    c.data = c.data.model_copy(update={"synthetic_vocab": min(32, cfg.vocab_size)})
    c.precision.dtype = precision
    c.zero_optimization.stage = stage
    if cfg.lora_r:
        c.peft = c.peft.model_copy(update={"method": "lora", "r": cfg.lora_r,
                                           "alpha": cfg.lora_scale * cfg.lora_r,
                                           "targets": list(cfg.lora_targets)})
    return Config.model_validate(c.model_dump(by_alias=True))  # validated as a whole


def engine_run(cfg: ModelConfig, batch, *, precision: str, seed: int = 1) -> Run:
    """``Run`` of ``torch_model(cfg, seed)`` inside the engine at ``precision`` (W = 1): the
    engine casts the model, ``engine.forward``/``backward`` give the loss and the grads."""
    model = torch_model(cfg, seed)
    engine = initialize(model, engine_config(cfg, OptimConfig(), precision=precision),
                        topology=build_topology([1], num_experts=cfg.num_experts), device="cpu")
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    assert {p.dtype for p in engine.params.values()} == {want}, "the engine did not cast"
    tokens_BS1 = torch.as_tensor(batch)
    loss, metrics = engine.forward(tokens_BS1)
    engine.backward(loss)
    grads = torch_fqns({k: torch.zeros_like(p) if p.grad is None else p.grad
                        for k, p in engine.params.items()})
    with torch.no_grad():
        logits, _ = model(tokens_BS1[:, :-1])  # the engine's model: cast in place
    return Run(loss.item(), metrics["ce"].item(), to_numpy(logits), grads)


jit_train_step = jax.jit(train_step, static_argnums=0)


def train_both(engine, tcfg, state, steps: int) -> tuple[object, list[dict], list[dict]]:
    """``steps`` steps of the torch engine and the reference on the same corpus batches:
    (the reference's final state, the engine's per-step metrics, the reference's)."""
    mine, ref = [], []
    for i in range(steps):
        batch = corpus_batch(i, batch=4)
        state, metrics = jit_train_step(tcfg, state, jnp.asarray(batch, jnp.int32))
        ref.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        mine.append(engine.train_step([torch.from_numpy(batch)]))
    return state, mine, ref
