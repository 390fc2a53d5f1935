"""Weight exchange both ways through safetensors files keyed by FQN (docs/model.md).

torch ``save_weights`` → ``moezero.reference.weights.load_params`` and reference ``save_params`` →
torch ``load_weights`` each give equal logits; torch ``load_weights`` rejects a file that does
not match with one line naming the FQNs; ep > 1 models are refused (not supported).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moezero.model.build import build_decoder
from moezero.reference.weights import from_fqn_dict, load_params, param_shapes, save_params
from parity_tests.models import TINY, jax_run, to_jax, tokens, torch_args, torch_model, torch_run
from parity_tests.tolerances import FP32
from parity_tests.weights import load_weights, save_weights
from tests.support.compare import assert_max_abs, torch_fqns

CFG = TINY  # the model tier's "dropless-k2": its compiled reference is reused


def random_params(seed: int) -> dict:
    """Reference params unlike any torch init: built by FQN in numpy."""
    rng = np.random.default_rng(seed)
    flat = {fqn: (1.0 + 0.1 * rng.standard_normal(shape) if fqn.endswith("norm.weight")
                  else 0.05 * rng.standard_normal(shape)).astype(np.float32)
            for fqn, shape in param_shapes(CFG).items()}
    return from_fqn_dict(flat, CFG)


def test_torch_file_loads_in_reference(tmp_path):
    model = torch_model(CFG, seed=5)
    save_weights(model, tmp_path / "w.safetensors")
    params = load_params(str(tmp_path / "w.safetensors"), CFG)
    batch = tokens(3)
    assert_max_abs(torch_run(model, batch).logits, jax_run(params, batch, CFG).logits,
                   FP32.logits_abs, "torch file → reference logits")


def test_reference_file_loads_in_torch(tmp_path):
    params = random_params(6)
    save_params(str(tmp_path / "w.safetensors"), params)
    model = torch_model(CFG, seed=0)
    load_weights(model, tmp_path / "w.safetensors")
    batch = tokens(3)
    assert_max_abs(torch_run(model, batch).logits, jax_run(params, batch, CFG).logits,
                   FP32.logits_abs, "reference file → torch logits")


def test_round_trip_is_exact_and_bf16_is_saved_as_fp32(tmp_path):
    model = torch_model(CFG, seed=5)
    save_weights(model.to(torch.bfloat16), tmp_path / "w.safetensors")
    fresh = torch_model(CFG, seed=9)
    load_weights(fresh, tmp_path / "w.safetensors")
    want = torch_fqns(model)
    assert all(np.array_equal(v, want[k]) for k, v in torch_fqns(fresh).items())
    assert np.array_equal(to_jax(fresh, CFG)["embed"]["weight"],
                          load_params(str(tmp_path / "w.safetensors"), CFG)["embed"]["weight"])


def test_load_weights_names_bad_fqns_in_one_line(tmp_path):
    from safetensors.torch import save_file

    model = torch_model(CFG, seed=5)
    flat = {k: v.clone() for k, v in model.state_dict().items()}
    del flat["layers.1.moe.experts.3.w2.weight"]
    flat["layers.0.moe.experts.4.w1.weight"] = flat["layers.0.moe.experts.0.w1.weight"].clone()
    flat["norm.weight"] = torch.ones(CFG.dim + 1)
    save_file(flat, tmp_path / "bad.safetensors")
    before = torch_fqns(model)
    with pytest.raises(ValueError) as err:
        load_weights(model, tmp_path / "bad.safetensors")
    msg = str(err.value)
    assert "\n" not in msg
    for fqn in ("layers.1.moe.experts.3.w2.weight", "layers.0.moe.experts.4.w1.weight",
                "norm.weight: (33,) != (32,)"):
        assert fqn in msg
    assert all(np.array_equal(v, before[k]) for k, v in torch_fqns(model).items())


def test_expert_parallel_models_are_refused(tmp_path):
    model = build_decoder(torch_args(CFG, ep_size=2), where="cpu", ep_rank=0)  # holds experts 0 and 1 only
    with pytest.raises(ValueError, match="ep_size=2"):
        save_weights(model, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="ep_size=2"):
        load_weights(model, tmp_path / "w.safetensors")
