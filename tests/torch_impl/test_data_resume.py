"""Resume at another world size continues the same global sample order (issue 17): train on a
prepared blend at W=2, save (the sampler position travels in the checkpoint's client state, in
global samples), resume at W=1; the sample ids consumed after the resume equal those of the
uninterrupted W=2 run. Uses the trainer's own ``setup``/``resume``/``_save``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moezero.config import Config, load_config
from moezero.data.prepare import PrepareOptions, prepare
from moezero.data.readers import ReadOptions
from moezero.train import _save, resume, setup
from tests.support.world import run_world
from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

pytest.importorskip("tokenizers")

MICRO = 2


def _train(cfg_data: dict, run_dir: str, steps: int, save: bool) -> tuple[dict, list[list]]:
    """This rank's data position after resuming ``checkpoint.load`` (if set) and its consumed
    sample ids per step."""
    cfg = Config.model_validate(cfg_data)
    engine, batches = setup(cfg, torch.device("cpu"))
    root = cfg.checkpoint.resolve_dir(run_dir)
    resume(cfg, engine, batches, root)
    start, ids = batches.state_dict(), []
    for _ in range(steps):
        batch = torch.from_numpy(batches.next())
        ids.append(batches.last_ids.tolist())
        engine.train_step([batch])
    if save:
        _save(engine, batches, root)
        engine.wait_checkpoint()
    engine.close()
    return start, ids


def _global(results: list[tuple[dict, list]]) -> list:
    """Global order of the ranks' sample ids: each step's rows of rank 0, then rank 1, ..."""
    per_rank = [ids for _, ids in results]
    return [tuple(i) for step in zip(*per_rank, strict=True) for rank in step for i in rank]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("resume")
    tok = save_tokenizer(train_bpe(sentences(300)), root / "tok")
    out = []
    for name, seed in (("a", 1), ("b", 2)):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in sentences(150, seed)))
        prepare([str(src)], root / name, tok, PrepareOptions(ReadOptions(), progress=False))
        out.append(str(root / name))
    return out


def _cfg(datasets, ep: int, **extra) -> dict:
    sets = [f"data.path={json.dumps(datasets)}", "data.weights=[1, 3]", "model.vocab_size=304",
            "model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=16",
            "moe.num_experts=2", f"moe.ep_size={ep}", "train.seq_len=16",
            f"train.micro_batch_size={MICRO}", "train.steps=8", "train.eval_every=0"]
    return load_config(None, sets + [f"{k}={v}" for k, v in extra.items()]).model_dump(
        by_alias=True)


def test_resume_at_another_world_size_continues_the_global_sample_order(datasets, tmp_path):
    whole = _global(run_world(_train, 2, tmp_path / "w", _cfg(datasets, 2), str(tmp_path / "w"),
                              4, False))
    first = _global(run_world(_train, 2, tmp_path / "a", _cfg(datasets, 2), str(tmp_path / "r"),
                              2, True))
    cfg = _cfg(datasets, 1, **{"checkpoint.load": str(tmp_path / "r" / "checkpoints")})
    resumed = run_world(_train, 1, tmp_path / "b", cfg, str(tmp_path / "r"), 4, False)
    assert resumed[0][0] == {"consumed_samples": 2 * 2 * MICRO, "seed": 0}  # global samples
    after = _global(resumed)
    assert first == whole[:8]
    assert after == whole[8:16]
    assert len(set(whole)) == 16 and {d for d, _ in whole} == {0, 1}
    assert np.mean([d for d, _ in whole]) == pytest.approx(0.75, abs=0.13)
