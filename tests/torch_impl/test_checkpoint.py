"""Engine checkpoints (torch_impl/checkpoint/): size on disk, bitwise resume in new processes,
resharding across (W, ep, stage), async saves, and strict loading.

Spawning ranks dominates the cost, so each world runs every case it can; module-scoped
fixtures share the worlds between tests. W = 1 runs in the test process.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import moezero.checkpoint.writer as cw
from moezero.checkpoint.core import CheckpointError
from moezero.config import Config
from moezero.distributed.topology import build_topology
from moezero.offload.options import IOOptions
from moezero.plan import store
from moezero.train import build_model, setup
from tests.support.compare import assert_close_by_fqn, rel_err
from tests.support.world import run_world
from tests.torch_impl.test_distributed import merged, small_config
from tests.torch_impl.tolerances import RTOL

KIB = 1024


def ccfg(*, world: int, stage: int = 2, ep: int = 1, dtype: str = "fp32", experts: int = 4,
         global_batch: int = 4, **moe) -> dict:
    """The tiny test model; ``global_batch`` sequences per step whatever the world size."""
    cfg = small_config(ep_size=ep, num_experts=experts, **moe)
    cfg.zero_optimization.stage = stage
    cfg.zero_optimization.reduce_bucket_size = 3000
    cfg.train.micro_batch_size = global_batch // world
    cfg.train.steps = 6  # the LR schedule's horizon; runs stop where they are told
    cfg.optimizer.warmup_steps = 2
    cfg.precision.dtype = dtype
    return cfg.model_dump(by_alias=True)


def train_run(cfg_data: dict, stop: int, *, load: str | None = None,
              saves: tuple[tuple[int, str, bool], ...] = ()) -> dict:
    """Train until ``global_steps == stop`` (resuming from ``load``), saving at each
    ``(step, root, background)``; per-step losses and final params by FQN."""
    cfg = Config.model_validate(cfg_data)
    engine, batches = setup(cfg, torch.device("cpu"))
    if load is not None:
        batches.load_state_dict(engine.load_checkpoint(load)["data"])
    start, losses = engine.global_steps, []
    while engine.global_steps < stop:
        losses.append(engine.train_step([torch.from_numpy(batches.next())])["loss"])
        for step, root, background in saves:
            if step == engine.global_steps:
                engine.save_checkpoint(root, state={"data": batches.state_dict()},
                                       background=background)
    engine.wait_checkpoint()
    return {"start": start, "losses": losses, "scale": engine.scaler.scale,
            "params": {k: p.detach().float().clone().numpy() for k, p in engine.params.items()}}


def run_all(cases: dict) -> dict:
    """``train_run(*args, **kwargs)`` for every named case, in order."""
    return {name: train_run(*args, **kwargs) for name, (args, kwargs) in cases.items()}


def tensor_files_digest(step_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(step_dir.glob("*.safetensors"))}


# ---------------------------------------------------------------------------- size on disk
SIZE_MODELS = {  # the default recipe's shape (4 layers, 8 experts) shrunk, and 32 experts
    "default": dict(n_layers=4, experts=8, dim=32, ffn_dim=64),
    "e32": dict(n_layers=2, experts=32, dim=32, ffn_dim=32),
}


def size_cfg(model: str, world: int, ep: int, cap: int | None = None) -> dict:
    m = SIZE_MODELS[model]
    cfg = Config.model_validate(ccfg(world=world, ep=ep, experts=m["experts"],
                                     global_batch=4, max_group_size=cap))
    cfg.model = cfg.model.model_copy(update={"n_layers": m["n_layers"], "dim": m["dim"],
                                             "ffn_dim": m["ffn_dim"]})
    return cfg.model_dump(by_alias=True)


def size_cases(world: int, root: str) -> dict:
    eps = [1] if world == 1 else [1, 2]
    cases = {f"{model}_w{world}_ep{ep}": size_cfg(model, world, ep)
             for model in SIZE_MODELS for ep in eps}
    if world == 2:  # a cap cuts parameters into fragments
        cases["default_w2_ep2_cap"] = size_cfg("default", 2, 2, cap=5000)
    return {name: ((cfg, 1), {"saves": ((1, f"{root}/{name}", False),)})
            for name, cfg in cases.items()}


def unique_state_bytes(cfg_data: dict) -> int:
    """12 B x every parameter element of the global model, every expert once (built at W=1)."""
    cfg = Config.model_validate(cfg_data)
    cfg.moe.ep_size = 1
    model = build_model(cfg, build_topology([1], num_experts=cfg.moe.num_experts))
    return 12 * sum(p.numel() for p in model.parameters())


def test_size_on_disk_is_the_unique_state(worlds):
    root, _ = worlds
    cases = {name: args[0] for w in (1, 2, 4) for name, (args, _) in size_cases(w, "").items()}
    assert len(cases) == 11  # 2 models x (W1 ep1, W2 ep1|2, W4 ep1|2) + a capped one
    for name, cfg in cases.items():
        step = root / name / "step_00000001"
        files = [p for p in step.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        allocated = sum(p.stat().st_blocks * 512 for p in files)
        unique = unique_state_bytes(cfg)
        bound = 1.001 * unique + 64 * KIB * len(files)
        assert size <= bound and allocated <= bound, (name, size, allocated, unique, len(files))
        tensors = sum(p.stat().st_size for p in step.glob("*.safetensors"))
        headers = sum(f.data_start for f in store.read_manifest(step).layout.files)
        assert tensors - headers == unique, name  # data is exactly 12 B per element
        assert store.verify(step) == [], name


# ---------------------------------------------------------------------------- bitwise resume
K, N = 2, 4
RESUME_CASES = {  # name -> (config, async save at K)
    "fp32_s2": (ccfg(world=2, stage=2, ep=2), False),
    "bf16_s2": (ccfg(world=2, stage=2, ep=2, dtype="bf16"), True),
    "fp32_s0": (ccfg(world=2, stage=0, ep=2), False),
    "bf16_s0": (ccfg(world=2, stage=0, ep=1, dtype="bf16", max_group_size=1000), False),
    "fp16_s1": (ccfg(world=2, stage=1, ep=2, dtype="fp16"), True),
    # odd groups over 2 ranks: rank 1's fp32 master (the params' range) is shorter than its shard
    "fp32_s1_padded": (ccfg(world=2, stage=1, ep=1, max_group_size=999), True),
}


def resume_cases(root: str, second: bool) -> dict:
    """Uninterrupted N-step runs saving at K and N; then (``second``) resumes at K."""
    if second:
        return {f"{name}_resumed": ((cfg, N), {"load": f"{root}/{name}/step_{K:08d}",
                                               "saves": ((N, f"{root}/{name}_resumed", False),)})
                for name, (cfg, _) in RESUME_CASES.items()}
    return {name: ((cfg, N), {"saves": ((K, f"{root}/{name}", background),
                                        (N, f"{root}/{name}_ref", False))})
            for name, (cfg, background) in RESUME_CASES.items()}


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_resume_in_new_processes_is_bitwise(worlds, name):
    root, results = worlds
    full, again = results[name], results[f"{name}_resumed"]
    for whole, part in zip(full, again, strict=True):
        assert part["start"] == K
        assert part["losses"] == whole["losses"][K:]
        assert part["scale"] == whole["scale"]
        assert whole["params"].keys() == part["params"].keys()
        for fqn, value in whole["params"].items():
            assert torch.equal(torch.from_numpy(part["params"][fqn]), torch.from_numpy(value)), fqn
        assert whole["losses"][0] != whole["losses"][-1]
    # master and both moments too: the final checkpoints' tensor files are byte-identical
    ref = tensor_files_digest(root / f"{name}_ref" / f"step_{N:08d}")
    assert ref and tensor_files_digest(root / f"{name}_resumed" / f"step_{N:08d}") == ref


def test_async_save_holds_the_state_of_its_step(worlds):
    """The async save at K (training went on while it was written; the sync save at N waited
    for it) holds the step-K state; the bf16_s2 resume from it is bitwise (above)."""
    root, _ = worlds
    ckpt = root / "bf16_s2" / f"step_{K:08d}"
    assert store.verify(ckpt) == []
    manifest = store.read_manifest(ckpt)
    assert manifest.state["engine"]["global_steps"] == K
    assert manifest.state["client"]["data"]["step"] == K
    assert len(manifest.state["rng"]) == 2 and manifest.topology["world_size"] == 2


# ---------------------------------------------------------------------------- reshard matrix
MATRIX = {"w2_ep2_s2": (2, 2, 2), "w4_ep2_s1": (4, 2, 1), "w1_ep1_s0": (1, 1, 0)}
STEPS = 2  # after the load


def matrix_cfg(world: int, ep: int, stage: int) -> dict:
    cfg = Config.model_validate(ccfg(world=world, stage=stage, ep=ep))
    cfg.moe.aux_loss_coef = 0.0  # per-rank aux loss is the one W-dependent term (docs/model.md, "MoE layer")
    return cfg.model_dump(by_alias=True)


def matrix_cases(world: int, root: str, second: bool) -> dict:
    """Each (W, ep, stage) of MATRIX saves at K and runs on (the uninterrupted run); then
    (``second``) loads every other one's checkpoint and runs the same steps."""
    out = {}
    for name, (w, ep, stage) in MATRIX.items():
        if second and w == world:
            out.update({f"{src}->{name}": ((matrix_cfg(w, ep, stage), K + STEPS),
                                           {"load": f"{root}/{src}/step_{K:08d}"})
                        for src in MATRIX if src != name})
        elif w == world:
            out[name] = ((matrix_cfg(w, ep, stage), K + STEPS),
                         {"saves": ((K, f"{root}/{name}", False),)})
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Two rounds of worlds W = 1, 2, 4 running every case of this file; the second round
    (new processes) loads what the first saved. Results: case name -> per-rank results."""
    root = tmp_path_factory.mktemp("worlds")
    results = {}
    for second in (False, True):
        for world in (1, 2, 4):
            cases = matrix_cases(world, str(root), second)
            if world == 2:
                cases.update(resume_cases(str(root), second))
            if not second:
                cases.update(size_cases(world, str(root)))
            out = run_world(run_all, world, root / f"round{int(second)}_w{world}", cases,
                            timeout_s=300)
            results.update({name: [r[name] for r in out] for name in cases})
    return root, results


def test_reshard_matrix_continues_the_run(worlds):
    _, results = worlds
    (reference,) = results["w1_ep1_s0"]  # the single-process uninterrupted run
    for name in MATRIX:  # every uninterrupted run agrees with it
        assert_close_by_fqn(merged(results[name], "params"), reference["params"], RTOL["fp32"])
    combos = [name for name in results if "->" in name]
    assert len(combos) == 6
    for combo in combos:
        runs = results[combo]
        assert runs[0]["start"] == K, combo
        for got, want in zip(runs[0]["losses"], reference["losses"][K:], strict=True):
            assert rel_err(got, want) <= RTOL["fp32"], (combo, got, want)
        assert_close_by_fqn(merged(runs, "params"), reference["params"], RTOL["fp32"])


# ---------------------------------------------------------------------------- strict loading
@pytest.fixture(scope="module")
def w1_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("w1")
    cfg = ccfg(world=1, stage=2)
    train_run(cfg, 1, saves=((1, str(root), False),))
    return cfg, root / "step_00000001"


def _engine(cfg_data: dict):
    return setup(Config.model_validate(cfg_data), torch.device("cpu"))[0]


def test_load_rejects_a_manifest_naming_files_outside(w1_ckpt, tmp_path):
    cfg, ckpt = w1_ckpt
    bad = tmp_path / "step_00000001"
    bad.mkdir()
    for p in ckpt.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    outside = tmp_path / "evil.safetensors"
    outside.write_bytes((ckpt / "model-00001-of-00010.safetensors").read_bytes())
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][0]["name"] = "../evil.safetensors"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    engine = _engine(cfg)
    before = {k: p.detach().clone() for k, p in engine.params.items()}
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        engine.load_checkpoint(bad)
    assert all(torch.equal(before[k], p) for k, p in engine.params.items())


def test_load_refuses_truncated_misshapen_and_unfinished_checkpoints(w1_ckpt, tmp_path):
    cfg, ckpt = w1_ckpt
    bad = tmp_path / "step_00000001"
    bad.mkdir()
    for p in ckpt.iterdir():
        (bad / p.name).write_bytes(p.read_bytes()[:-4] if "optim-00003" in p.name
                                   else p.read_bytes())
    with pytest.raises(CheckpointError, match=r"optim-00003-of-00010.safetensors is truncated"):
        _engine(cfg).load_checkpoint(bad)
    wider = Config.model_validate(cfg)
    wider.model.ffn_dim = 64
    with pytest.raises(CheckpointError, match=r"shape \(48, 32\) in the checkpoint, \(64, 32\)"):
        _engine(wider.model_dump(by_alias=True)).load_checkpoint(ckpt)
    partial = tmp_path / "step_00000001.partial"  # complete files, but never committed
    shutil.copytree(ckpt, partial)
    with pytest.raises(CheckpointError, match="an unfinished save"):
        _engine(cfg).load_checkpoint(partial)
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _engine(cfg).load_checkpoint(tmp_path / "empty_root")


def test_checkpoint_module_never_unpickles():
    """No pickle-based reader in the code (docstrings may say 'pickle'): no pickle/marshal
    import, no ``torch.load``/``np.load``, no ``*_object`` collectives (they pickle)."""
    package = Path(__file__).parents[2] / "torch_impl" / "checkpoint"
    used = set()
    trees = [ast.parse(path.read_text()) for path in sorted(package.glob("*.py"))]
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            used.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            used.add(node.module or "")
            used.update(a.name for a in node.names)
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else ""
            used.add(f"{base}.{node.attr}")
        elif isinstance(node, ast.Name):
            used.add(node.id)
    bad = {u for u in used if re.search(r"pickle|marshal|shelve|dill|(torch|np|numpy)\.load$"
                                         r"|_object(_list)?$", u)}
    assert not bad and "json" in used, bad


def test_loading_a_checkpoint_root_takes_latest(w1_ckpt):
    cfg, ckpt = w1_ckpt
    engine = _engine(cfg)
    state = engine.load_checkpoint(ckpt.parent)
    assert engine.global_steps == 1 and state["data"]["step"] == 1
    saved = store.read_tensors(ckpt, store.read_manifest(ckpt))
    for fqn, p in engine.params.items():
        assert np.array_equal(p.detach().numpy(), saved[fqn]), fqn



# ---------------------------------------------------------------------------- O_DIRECT writes
def test_range_writer_bytes_match_the_buffered_path(tmp_path):
    """Two writers (two ranks) take turns over disjoint ranges of one file: short ones, ones at
    unaligned offsets, one spanning several staging chunks. The file and the checksums equal
    ``store.write_range``'s, and the aligned bulk went through O_DIRECT."""
    size = 40 * 4096 + 123
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    cuts = [0, 100, 3100, 3100 + 5 * 4096 + 17, 8 * 4096, 8 * 4096 + 40, size]
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    for name in ("direct", "buffered"):
        store._create(tmp_path / name, size)  # preallocated, as write_headers creates them
    want = [store.write_range(tmp_path / "buffered", a, data[a:b]) for a, b in ranges]
    with (cw.RangeWriter(IOOptions(stage_bytes=4 * 4096, direct_min_bytes=0)) as one,
          cw.RangeWriter(IOOptions(stage_bytes=8192, direct_min_bytes=0)) as two):
        got = [(one, two)[i % 2](tmp_path / "direct", a, data[a:b])
               for i, (a, b) in enumerate(ranges)]
    assert got == want == [zlib.crc32(data[a:b]) for a, b in ranges]
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    if not one._direct[str(tmp_path)]:
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT (buffered fallback checked)")
    direct = [w.aio.stats["direct_bytes"] for w in (one, two)]
    assert min(direct) > 0 and sum(direct) >= 30 * 4096, direct


def test_range_writer_refuses_a_range_past_the_end(tmp_path):
    store._create(tmp_path / "f", 100)
    with (cw.RangeWriter(IOOptions(direct_min_bytes=0)) as write,
          pytest.raises(ValueError, match=r"f: range \[90, 110\) is outside the 100-byte file")):
        write(tmp_path / "f", 90, np.zeros(20, np.uint8))
    assert (tmp_path / "f").stat().st_size == 100


def test_flush_is_one_syncfs_or_an_fsync_per_file(tmp_path, monkeypatch):
    """A save flushes with one syncfs per rank on Linux >= 5.8 on ext4/xfs/btrfs/f2fs, else
    (another filesystem, or ``IOOptions(syncfs=False)``) fsyncs each file it wrote; a syncfs
    error (not 'unsupported') is raised, naming the folder, and nothing is committed."""
    cfg = Config.model_validate(ccfg(world=1, stage=2))
    engine, _ = setup(cfg, torch.device("cpu"))
    fsynced, syncfs = [], []
    fsync_file = store.fsync_file
    monkeypatch.setattr(store, "fsync_file", lambda p: (fsynced.append(Path(p)), fsync_file(p)))

    def fsynced_all(step):
        data = {p.name for p in step.iterdir() if p.suffix == ".safetensors"}
        return data and {p.name for p in fsynced if p.suffix == ".safetensors"} == data

    with monkeypatch.context() as m:  # NFS, FUSE, overlay, tmpfs...: per-file fsyncs
        m.setattr(cw, "_fs_type", lambda folder: 0x6969)  # NFS's magic
        assert fsynced_all(engine.save_checkpoint(tmp_path / "nfs"))
    fsynced.clear()
    monkeypatch.setattr(cw, "_fs_type", lambda folder: 0xEF53)  # ext4, wherever tmp lives
    real = cw.system_syncfs()
    if real is not None:  # Linux >= 5.8
        monkeypatch.setattr(cw, "system_syncfs", lambda: lambda fd: (syncfs.append(fd), real(fd))[1])
        step = engine.save_checkpoint(tmp_path / "syncfs")
        assert len(syncfs) == 1 and not [p for p in fsynced if p.suffix == ".safetensors"]
        assert store.verify(step) == []
    no_syncfs, _ = setup(cfg, torch.device("cpu"), IOOptions(syncfs=False))
    assert fsynced_all(no_syncfs.save_checkpoint(tmp_path / "fsync"))
    monkeypatch.setattr(cw, "system_syncfs", lambda: lambda fd: -1)
    monkeypatch.setattr(cw.ctypes, "get_errno", lambda: errno.EIO)
    with pytest.raises(CheckpointError, match="syncfs: Input/output error"):
        engine.save_checkpoint(tmp_path / "eio")
    assert store.find_latest(tmp_path / "eio") is None


def test_folder_flush_takes_the_syncfs_it_is_given(tmp_path, monkeypatch):
    """``FolderFlush(folder, syncfs)``: the given syncfs once where it is enough; None, or a
    filesystem it is not enough on, fsyncs each file."""
    (tmp_path / "a").write_bytes(b"x")
    fsynced, calls = [], []
    monkeypatch.setattr(store, "fsync_file", lambda p: fsynced.append(Path(p).name))
    monkeypatch.setattr(cw, "_fs_type", lambda folder: 0xEF53)
    with cw.FolderFlush(tmp_path, lambda fd: calls.append(fd) or 0) as flush:
        flush.flush(["a"])
    assert len(calls) == 1 and fsynced == []
    with cw.FolderFlush(tmp_path, None) as flush:
        flush.flush(["a"])
    assert fsynced == ["a"]
    monkeypatch.setattr(cw, "_fs_type", lambda folder: 0x01021994)  # tmpfs
    with cw.FolderFlush(tmp_path, lambda fd: calls.append(fd) or 0) as flush:
        flush.flush(["a"])
    assert len(calls) == 1 and fsynced == ["a", "a"]


def test_fs_type_reads_statfs():
    assert cw._fs_type(Path("/nonexistent/folder")) is None
    if Path("/proc/self").exists():
        assert cw._fs_type(Path("/proc")) == 0x9FA0  # PROC_SUPER_MAGIC


def test_direct_save_is_byte_identical_to_buffered(tmp_path, monkeypatch):
    """A W=1 engine saved with O_DIRECT and with the buffered fallback (two engines built
    alike, one step each): every file equal, ``verify`` clean; ranges at unaligned offsets and
    shorter than 4096 bytes are among them."""
    stats, close = [], cw.RangeWriter.close
    monkeypatch.setattr(cw.RangeWriter, "close",
                        lambda self: (close(self), stats.append(self.aio and self.aio.stats)))
    for direct in (True, False):
        # every range, however short, takes O_DIRECT when it is on
        io = IOOptions(direct_io=direct, direct_min_bytes=0)
        engine, batches = setup(Config.model_validate(ccfg(world=1, stage=2)),
                                torch.device("cpu"), io)
        engine.train_step([torch.from_numpy(batches.next())])
        engine.save_checkpoint(tmp_path / str(direct), state={"data": batches.state_dict()})
    dirs = [tmp_path / str(direct) / "step_00000001" for direct in (True, False)]
    names = sorted(p.name for p in dirs[0].iterdir())
    assert names == sorted(p.name for p in dirs[1].iterdir()) and len(names) > 10
    for name in names:
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name
    assert store.verify(dirs[0]) == []
    records = store.read_manifest(dirs[0]).checksums
    assert any(r.offset % 4096 and r.length > 3 * 4096 for r in records)
    assert any(r.offset and r.length < 4096 for r in records)
    assert stats[1] is None  # the fallback is store.write_range
    if not stats[0] or stats[0]["direct_bytes"] == 0:
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    assert stats[0]["direct_bytes"] > 0 and stats[0]["buffered_bytes"] > 0
