"""NVMe offload I/O (torch_impl/offload/aio.py, swapdir.py): aligned buffers, AsyncIO round
trips, O_DIRECT and its fallback, swap file names and folders, the free-space check, and
store.copy_range's in-kernel copy."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.config import ConfigError
from moezero.offload import swapdir
from moezero.offload.aio import ALIGN, AsyncIO, OffloadIOError, aligned_empty, aligned_size
from moezero.offload.swapdir import OPTIMIZER_KEY, PARAM_KEY, SwapDir, swap_name
from moezero.plan import store

SHM = Path("/dev/shm")
DIRECT_FLAG = getattr(os, "O_DIRECT", 0)


def filled(numel: int, dtype: torch.dtype, *, aligned: bool = True, seed: int = 0) -> torch.Tensor:
    out = aligned_empty(numel, dtype) if aligned else torch.empty(numel, dtype=dtype)
    return out.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def folders(tmp_path: Path) -> list[Path]:
    shm = [SHM] if SHM.is_dir() and os.access(SHM, os.W_OK) else []
    return [tmp_path, *shm]


# ---------------------------------------------------------------- aligned buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 1024, 4097, 100_003])
def test_aligned_empty_is_aligned_exact_and_rounded(numel, dtype):
    t = aligned_empty(numel, dtype, pin=True)  # pin is ignored without CUDA, never refused
    assert t.numel() == numel and t.dtype == dtype and t.device.type == "cpu"
    assert t.data_ptr() % ALIGN == 0 and t.is_contiguous()
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert room >= aligned_size(numel * t.element_size())
    assert not t.is_pinned() or torch.cuda.is_available()


def _mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ``ptr``."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc smaps")
def test_mapped_buffers_are_private_anonymous_memory():
    """A large buffer is the process's own anonymous memory, not shmem: Python's default
    shared mapping faulted every page through shmem (no huge pages, counted as shared)."""
    t = aligned_empty(8 << 20, torch.uint8).fill_(1)
    fields = _mapping_of(t.data_ptr())
    assert fields["Anonymous"] == fields["Rss"] != "0 kB", fields
    assert fields["Shared_Dirty"] == "0 kB", fields


# ---------------------------------------------------------------- AsyncIO


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel,offset", [(1, 0), (1029, 0), (1029, 12), (5003, 4096),
                                          (70_001, 8190), (300_000, 3 * ALIGN)])
@pytest.mark.parametrize("aligned", [True, False])
def test_round_trip_at_offsets(tmp_path, dtype, numel, offset, aligned):
    for folder in folders(tmp_path):
        path = folder / f"moezero-test-{os.getpid()}.swap"
        src, dst = filled(numel, dtype, aligned=aligned), aligned_empty(numel, dtype)
        try:
            with AsyncIO(3, chunk_bytes=64 * 1024) as aio:
                assert aio.write(path, src, offset).result() == src.nbytes
                assert aio.read(path, dst, offset).result() == src.nbytes
            assert torch.equal(src, dst), folder
            assert path.read_bytes()[offset:] == raw(src)
            assert path.stat().st_size == offset + src.nbytes
        finally:
            path.unlink(missing_ok=True)


def test_chunks_on_many_threads_give_the_same_bytes(tmp_path, monkeypatch):
    src = filled(3 * 262_144 + 5, torch.float32, seed=1)
    with AsyncIO(1, chunk_bytes=64 << 20) as aio:
        aio.write(tmp_path / "one", src, 100).result()
    threads, real = set(), os.pwritev

    def pwritev(fd, buffers, offset):
        threads.add(threading.current_thread().name)
        threading.Event().wait(0.002)  # let every worker pick up chunks
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with AsyncIO(4, chunk_bytes=ALIGN) as aio:
        aio.write(tmp_path / "many", src, 100).result()
        dst = aligned_empty(src.numel(), src.dtype)
        aio.read(tmp_path / "many", dst, 100).result()
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()
    assert torch.equal(dst, src) and len(threads) > 1


def test_concurrent_requests_on_one_file(tmp_path):
    parts = [filled(1000 + i, torch.float32, seed=i) for i in range(16)]
    offsets = np.cumsum([0] + [p.nbytes for p in parts]).tolist()
    with AsyncIO(4, chunk_bytes=ALIGN) as aio:
        futures = [aio.write(tmp_path / "f", p, o) for p, o in zip(parts, offsets, strict=False)]
        assert [f.result() for f in futures] == [p.nbytes for p in parts]
    assert (tmp_path / "f").read_bytes() == b"".join(raw(p) for p in parts)


def test_o_direct_is_used_where_the_probe_allows_it(tmp_path):
    src = filled(3 * 1024 + 3, torch.float32)  # 3 aligned blocks + a 12-byte tail
    with AsyncIO(2) as aio:
        aio.write(tmp_path / "f", src).result()
        if not aio.uses_direct(tmp_path / "f"):
            pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT (buffered fallback)")
        dfd = aio._files[str(tmp_path / "f")].dfd
        assert fcntl.fcntl(dfd, fcntl.F_GETFL) & DIRECT_FLAG
        assert aio.stats["direct_bytes"] == 3 * ALIGN and aio.stats["buffered_bytes"] == 12
        dst = aligned_empty(src.numel(), src.dtype)
        aio.read(tmp_path / "f", dst).result()
        unaligned = filled(10, torch.float32, aligned=False)
        aio.read(tmp_path / "f", unaligned, 4).result()  # misaligned buffer: all buffered
    assert torch.equal(dst, src) and raw(unaligned) == raw(src)[4:44]


def _refuse_open(monkeypatch):
    real = os.open

    def fake(path, flags, *args, **kw):
        if flags & DIRECT_FLAG:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake)


def _refuse_writes(monkeypatch):  # the probe (a read) passes, the first direct write fails
    real = os.pwritev

    def fake(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & DIRECT_FLAG:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", fake)


@pytest.mark.skipif(not DIRECT_FLAG, reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("refuse", [_refuse_open, _refuse_writes], ids=["open", "write"])
def test_refused_o_direct_falls_back_with_one_logged_reason(tmp_path, monkeypatch, caplog, refuse):
    refuse(monkeypatch)  # what tmpfs before Linux 6.6 and some FUSE filesystems do
    src = filled(5000, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="moezero.offload"), AsyncIO(2) as aio:
        for name in ("a", "b"):
            aio.write(tmp_path / name, src, ALIGN).result()
            dst = aligned_empty(src.numel(), src.dtype)
            aio.read(tmp_path / name, dst, ALIGN).result()
            assert torch.equal(dst, src)
        assert not aio.uses_direct(tmp_path / "a") and aio.stats["direct_bytes"] == 0
    [record] = caplog.records
    assert record.name == "moezero.offload" and str(tmp_path) in record.getMessage()
    assert "EINVAL" in record.getMessage() and "\n" not in record.getMessage()


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_dev_shm_works_direct_or_with_its_reason_logged(caplog):
    path = SHM / f"moezero-test-{os.getpid()}.swap"
    src = filled(4096 + 1, torch.float32)
    try:
        with caplog.at_level(logging.WARNING, logger="moezero.offload"), AsyncIO(2) as aio:
            aio.write(path, src).result()
            direct = aio.uses_direct(path)  # tmpfs has O_DIRECT since Linux 6.6
        assert path.read_bytes() == raw(src)
        logged = [r.getMessage() for r in caplog.records]
        if direct:
            assert logged == [] and aio.stats["direct_bytes"] == src.nbytes // ALIGN * ALIGN
        else:
            assert len(logged) == 1 and str(SHM) in logged[0]
    finally:
        path.unlink(missing_ok=True)


def test_truncated_or_missing_file_fails_on_result_with_path_and_range(tmp_path):
    (tmp_path / "short").write_bytes(bytes(1000))
    with AsyncIO(2) as aio:
        future = aio.read(tmp_path / "short", aligned_empty(3000, torch.float32), 4096)
        with pytest.raises(OffloadIOError) as err:
            future.result()
        msg = str(err.value)
        assert f"{tmp_path / 'short'}: read of bytes [4096, 16096) failed" in msg
        assert "ends at byte 1000" in msg and "\n" not in msg
        with pytest.raises(OffloadIOError, match=r"missing: read of bytes \[0, 4\) .*No such"):
            aio.read(tmp_path / "missing", torch.zeros(1)).result()
        with pytest.raises(ValueError, match="contiguous CPU tensor"):
            aio.write(tmp_path / "x", torch.zeros(4, 4).t())


def test_fsync_descriptor_cache_and_close(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    before = len(os.listdir("/proc/self/fd"))
    aio = AsyncIO(2, chunk_bytes=ALIGN, fsync=True)
    for _ in range(3):
        aio.write(tmp_path / "f", filled(3000, torch.float32)).result()
    assert len(synced) == 3 and len(aio._files) == 1  # one fsync per request, one open
    aio.close()
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises(RuntimeError, match="closed"):
        aio.write(tmp_path / "f", torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_round_trip(tmp_path):  # GDS where cuFile works, else pinned staging
    src = torch.randn(70_001, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    with AsyncIO(2) as aio:
        aio.write(tmp_path / "g", src, ALIGN).result()
        aio.read(tmp_path / "g", dst, ALIGN).result()
    assert torch.equal(src, dst)


# ---------------------------------------------------------------- swap names


def _decode(enc: str) -> str:
    """Inverse of swap_name's encoding (the test's proof that it is injective)."""
    out, i = bytearray(), 0
    while i < len(enc):
        run = len(enc[i:]) - len(enc[i:].lstrip("_"))
        if run:
            assert run == 1 or run % 2 == 0, enc
            out += b"_" if run == 1 else b"/" * (run // 2)
            i += run
        elif enc[i] == "%":
            out.append(int(enc[i + 1:i + 3], 16))
            i += 3
        else:
            out += enc[i].encode()
            i += 1
    return out.decode("utf-8", "surrogatepass")


def test_swap_name_is_readable_and_stable():
    assert swap_name("moe/ep_size_2/layer3/expert5/0", "exp_avg") == \
        "moe__ep_size_2__layer3__expert5__0.exp_avg.swap"
    assert swap_name("dense/decay/0", "master") == "dense__decay__0.master.swap"
    assert swap_name("a__b", "param") != swap_name("a/b", "param")
    with pytest.raises(ValueError):
        swap_name("", "master")
    with pytest.raises(ValueError):
        swap_name("g", "ex.p")


names = st.text(st.sampled_from("ab_/%.-é~ ") | st.characters(), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(name=names, state=st.sampled_from(["master", "exp_avg", "exp_avg_sq", "param"]))
def test_swap_name_is_injective_and_a_safe_file_name(name, state):
    file = swap_name(name, state)
    assert "/" not in file and "\0" not in file and not file.startswith(".")
    assert len(file.encode()) <= 255 and file == swap_name(name, state)
    enc = file[:-len(f".{state}.swap")]
    if "+" in enc:  # "+" is always escaped, so it marks a hashed long name
        assert len(enc) == 200 and len(name) > 16  # 16 chars encode to at most 192
    else:
        assert _decode(enc) == name


def test_long_names_are_hashed_and_distinct():
    a, b = "moe/" + "x" * 300 + "/0", "moe/" + "x" * 300 + "/1"
    assert swap_name(a, "master") != swap_name(b, "master")
    assert len(swap_name(a, "exp_avg_sq").encode()) <= 255 and "+" in swap_name(a, "master")


# ---------------------------------------------------------------- swap folders

GROUPS = {"dense/decay/0": 1000, "moe/ep_size_2/layer3/expert5/0": 4096,
          "moe/ep_size_2/layer3/expert5/1": 5}


def _run(root: Path, groups: dict[str, int]) -> list[tuple[str, int]]:
    swap = SwapDir(root, 3)
    swap.check(sum(aligned_size(4 * n) for n in groups.values()) * 3)
    with AsyncIO(2) as aio:
        for name, numel in groups.items():
            for state in ("master", "exp_avg", "exp_avg_sq"):
                path = swap.allocate(name, state, 4 * numel)
                assert path == root / "moezero-swap" / "rank00003" / swap_name(name, state)
                aio.write(path, filled(numel, torch.float32)).result()
    swap.release()  # the job ends: its files stay for the next one to take over
    return swap.listing()


def test_two_runs_give_identical_listings(tmp_path):
    first = _run(tmp_path, GROUPS)
    assert len(first) == 9 and all(size % ALIGN == 0 and size for _, size in first)
    assert _run(tmp_path, GROUPS) == first


def test_allocate_rounds_resizes_and_reserves(tmp_path):
    swap = SwapDir(tmp_path, 0)
    path = swap.allocate("g/0", "master", 1)
    assert path.stat().st_size == ALIGN and path.stat().st_blocks * 512 >= ALIGN
    assert swap.allocate("g/0", "master", 10_000).stat().st_size == 3 * ALIGN
    assert swap.allocate("g/0", "master", 0).stat().st_size == 0
    assert swap.listing() == [("g__0.master.swap", 0)]


def test_cleanup_removes_ours_and_leaves_foreign_files(tmp_path):
    _run(tmp_path, GROUPS)
    (tmp_path / "theirs.bin").write_bytes(b"x")
    SwapDir(tmp_path, 3).acquire().cleanup()  # the dead run's folder, taken over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.bin"]
    _run(tmp_path, GROUPS)
    swap = SwapDir(tmp_path, 3).acquire()
    (swap.folder / "notes.txt").write_text("mine")
    swap.cleanup()
    assert swap.listing() == [("notes.txt", 4)]
    SwapDir(tmp_path, 9).cleanup()  # never held: a no-op
    assert not (tmp_path / "moezero-swap" / "rank00009").exists()


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _check_fails(root: Path, where: Path, total: int, key: str, match: str) -> None:
    before = _tree(root)
    with pytest.raises(ConfigError, match=match) as err:
        SwapDir(where, 0).check(total, key)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{key}: ") and str(where) in msg
    assert _tree(root) == before  # nothing created


def test_check_refuses_missing_path_file_and_full_disk(tmp_path):
    _check_fails(tmp_path, tmp_path / "absent", 1, OPTIMIZER_KEY, "no such directory")
    (tmp_path / "file").write_text("x")
    _check_fails(tmp_path, tmp_path / "file", 1, PARAM_KEY, "not a directory")
    _check_fails(tmp_path, tmp_path, 1 << 60, OPTIMIZER_KEY,
                 rf"need {1 << 60} bytes \(1073741824.00 GiB\), only \d+ bytes .* free")
    SwapDir(tmp_path, 0).check(ALIGN)
    assert _tree(tmp_path) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_check_refuses_an_unwritable_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        _check_fails(tmp_path, ro, 1, OPTIMIZER_KEY, "not writable")
    finally:
        ro.chmod(0o700)


def test_check_refuses_a_directory_access_denies(tmp_path, monkeypatch):
    """The same check for root, which ``os.access`` is made to refuse."""
    ro, real = tmp_path / "ro", os.access
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro and real(p, mode))
    _check_fails(tmp_path, ro, 1, PARAM_KEY, "swap directory is not writable")


def test_check_counts_our_existing_files_as_free(tmp_path, monkeypatch):
    swap = SwapDir(tmp_path, 0)
    swap.allocate("g", "master", 40 * ALIGN)
    (swap.folder / "foreign").write_bytes(bytes(8 * ALIGN))
    usage = swapdir.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(swapdir.shutil, "disk_usage", lambda p: usage._replace(free=10 * ALIGN))
    swap.check(50 * ALIGN)
    with pytest.raises(ConfigError, match=f"need {50 * ALIGN + 1} bytes .* only {50 * ALIGN} "):
        swap.check(50 * ALIGN + 1)


# ---------------------------------------------------------------- store.copy_range


def test_copy_range_copies_in_the_kernel_with_the_crc_of_the_bytes(tmp_path, monkeypatch):
    calls, real = [], os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (calls.append(a), real(*a))[1])
    monkeypatch.setattr(store, "CHUNK", 3 * ALIGN)
    data = np.random.default_rng(0).bytes(10 * ALIGN + 77)
    (tmp_path / "swap").write_bytes(data)
    (tmp_path / "ckpt").write_bytes(bytes(12 * ALIGN))
    crc = store.copy_range(tmp_path / "swap", 5, tmp_path / "ckpt", 100, 10 * ALIGN)
    assert crc == zlib.crc32(data[5:5 + 10 * ALIGN]) and len(calls) >= 4
    assert (tmp_path / "ckpt").read_bytes()[100:100 + 10 * ALIGN] == data[5:5 + 10 * ALIGN]


@pytest.mark.parametrize("code", [errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                                  errno.EIO])
def test_copy_range_falls_back_to_pread_pwrite_when_refused(tmp_path, monkeypatch, code):
    def refuse(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    data = np.random.default_rng(1).bytes(3 * ALIGN)
    (tmp_path / "swap").write_bytes(data)
    (tmp_path / "ckpt").write_bytes(bytes(3 * ALIGN))
    if code == errno.EIO:  # a real I/O error is not a reason to fall back
        with pytest.raises(OSError, match="Input/output"):
            store.copy_range(tmp_path / "swap", 0, tmp_path / "ckpt", 0, len(data))
        return
    crc = store.copy_range(tmp_path / "swap", 0, tmp_path / "ckpt", 0, len(data))
    assert crc == zlib.crc32(data)
    assert (tmp_path / "ckpt").read_bytes() == data


def test_copy_range_between_swap_and_checkpoint_on_different_filesystems(tmp_path):
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    src = SHM / f"moezero-copy-{os.getpid()}.swap"
    data = np.random.default_rng(2).bytes(2 * ALIGN + 9)
    try:
        src.write_bytes(data)
        (tmp_path / "ckpt").write_bytes(bytes(len(data)))
        assert store.copy_range(src, 0, tmp_path / "ckpt", 0, len(data)) == zlib.crc32(data)
        assert (tmp_path / "ckpt").read_bytes() == data
    finally:
        src.unlink(missing_ok=True)


def test_large_aligned_buffers_go_back_to_the_os_when_freed():
    """Buffers of ``aio.MAPPED_BYTES`` (1 MiB) or more are mappings of their own: freeing the last view (here a
    slice in another dtype) returns their pages at once, even after glibc has raised its mmap
    threshold (as freeing a 30 MiB block does), when a 16 MiB malloc block would stay."""
    MiB = 1 << 20  # aio.MAPPED_BYTES: buffers from this size on are mapped

    def rss() -> int:
        return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) << 10

    torch.ones(30 << 18).sum()  # 30 MiB, freed: glibc's threshold rises to 30 MiB
    t = aligned_empty(16 * MiB // 4, torch.float32)
    t.fill_(1.0)
    view = t[1:].view(torch.int32)
    del t
    before = rss()
    assert int(view[0]) == 0x3F800000
    del view
    assert before - rss() >= 15 * MiB
