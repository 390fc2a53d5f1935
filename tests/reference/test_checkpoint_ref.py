"""``moezero.reference.checkpoint``: a TrainState through the checkpoint layout and back (JAX only).

Saved under several plans (ep, group cap, split flag), read back bit for bit, and a run that
stops, saves, loads and continues equals the run that never stopped, bit for bit. The torch
side of the same layout is checked in ``parity_tests/test_checkpoint_parity.py``.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moezero.plan import store
from moezero.reference.checkpoint import CheckpointError, load_train_state, save_train_state
from moezero.reference.model import ModelConfig, init_params
from moezero.reference.optim import OptimConfig, TrainConfig, init_train_state, train_step
from moezero.reference.weights import to_fqn_dict

MODEL = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_dim=24, num_experts=4,
                    top_k=2)
CFG = TrainConfig(model=MODEL, optim=OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6),
                  world_size=2)
STEP = jax.jit(train_step, static_argnums=0)


def batch(i: int) -> jax.Array:
    return jax.random.randint(jax.random.key(100 + i), (4, 9), 0, MODEL.vocab_size)


@pytest.fixture(scope="module")
def trained():
    """(state after 2 steps, state after 4 uninterrupted steps, losses of steps 3-4)."""
    state = init_train_state(CFG, init_params(MODEL, jax.random.key(0)))
    for i in range(2):
        state, _ = STEP(CFG, state, batch(i))
    at2, losses = state, []
    for i in range(2, 4):
        state, m = STEP(CFG, state, batch(i))
        losses.append(float(m["loss"]))
    return at2, state, losses


def flat(state) -> dict[str, np.ndarray]:
    mu, nu = optax.tree.get(state.opt_state, "mu"), optax.tree.get(state.opt_state, "nu")
    return {f"{s}/{k}": np.asarray(v) for s, tree in (("p", state.params), ("m", mu), ("v", nu))
            for k, v in to_fqn_dict(tree).items()}


def assert_same_state(a, b) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype == np.float32, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
    assert counts(a) == counts(b)
    assert int(a.step) == int(b.step)


def counts(state) -> list[int]:
    """Every ``count`` of the optax state (Adam's and the schedule's)."""
    return [int(v) for _, v in optax.tree.get_all_with_path(state.opt_state, "count")]


@pytest.mark.parametrize(("ep", "cap", "split"), [(1, None, True), (2, 333, True),
                                                  (4, 1000, False)])
def test_round_trip_is_bit_exact_under_any_plan(tmp_path, trained, ep, cap, split):
    at2, _, _ = trained
    path = save_train_state(tmp_path, CFG, at2, ep_size=ep, max_group_size=cap,
                            split_by_expert=split, client={"data": {"step": 2, "seed": 0}})
    assert path.name == "step_00000002" and store.verify(path) == []
    loaded, manifest = load_train_state(tmp_path, CFG)  # the root: its latest
    assert_same_state(loaded, at2)
    assert manifest.state["client"] == {"data": {"step": 2, "seed": 0}}
    assert manifest.state["engine"]["step_count"] == 2
    if cap is not None:  # fragments: a parameter split across files
        assert any("@" in t.key for f in manifest.layout.files for t in f.tensors)


def test_resume_continues_bit_exactly(tmp_path, trained):
    at2, at4, losses = trained
    save_train_state(tmp_path, CFG, at2, max_group_size=500)
    state, _ = load_train_state(tmp_path / "step_00000002", CFG)
    resumed = []
    for i in range(2, 4):
        state, m = STEP(CFG, state, batch(i))
        resumed.append(float(m["loss"]))
    assert resumed == losses
    assert_same_state(state, at4)


def test_the_step_count_is_the_saved_one(tmp_path, trained):
    """``state.engine.step_count`` (optimizer steps) wins over the directory's step number."""
    at2, _, _ = trained
    path = save_train_state(tmp_path, CFG, at2, step=7)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["state"]["engine"]["step_count"] == 2
    loaded, _ = load_train_state(path, CFG)
    assert int(loaded.step) == 2
    assert counts(loaded) == [2, 2]


def test_a_different_model_is_refused_in_one_line(tmp_path, trained):
    save_train_state(tmp_path, CFG, trained[0])
    other = dataclasses.replace(CFG, model=dataclasses.replace(MODEL, ffn_dim=32))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight has shape \(24, 16\)"):
        load_train_state(tmp_path, other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_train_state(tmp_path / "empty", CFG)


def test_a_corrupted_moment_is_read_as_saved(tmp_path, trained):
    """The loader reads the bytes on disk (no cache): one flipped exp_avg_sq element shows."""
    at2, _, _ = trained
    path = save_train_state(tmp_path, CFG, at2)
    manifest = store.read_manifest(path)
    (f, t), *_ = manifest.layout.pieces("norm.weight", "exp_avg_sq")
    with open(path / f.name, "r+b") as fh:
        fh.seek(f.data_start + t.begin)
        fh.write(np.float32(123.0).tobytes())
    loaded, _ = load_train_state(path, CFG)
    nu = to_fqn_dict(optax.tree.get(loaded.opt_state, "nu"))["norm.weight"]
    assert float(nu[0]) == 123.0
    assert store.verify(path)  # and the checksum names it
    assert jnp.array_equal(loaded.params["norm"]["weight"], at2.params["norm"]["weight"])
