"""One host copy of a table per node, shared by every holder, freed with the last one."""

from __future__ import annotations

import os
import select
import signal
import time

import numpy as np
import pytest

from ray_ple.errors import PleModelError
from ray_ple.offload.table_broker import broker_name
from ray_ple.offload.table_file import TableFile, fingerprint, load_rows, locate_tensor
from ray_ple.offload.table_segment import TableSegment
from ray_ple.offload.table_store import acquire_table
from ray_ple.protocol.peers import name_holder
from ray_ple.protocol.shm import PAGE, SharedSegment
from tests.leftovers import hugetlb_pool, ple_shm_entries, shmem_bytes
from tests.rig import spec_for, start_offload, start_worker, write_checkpoint

ROWS, LAYERS, DIM = 16384, 32, 64  # 64 MiB of bf16: far above the noise of /proc/meminfo


def _table_maps(pid: int) -> set[tuple[int, str]]:
    """(inode, permissions) of the big shared mappings a process holds (the table's)."""
    found = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if end - start >= ROWS * LAYERS * DIM * 2 and parts[4] != "0":
                found.add((int(parts[4]), parts[1]))
    return found


def _table_inode(pid: int) -> set[int]:
    maps = _table_maps(pid)
    assert {perms for _, perms in maps} == {"r--s"}, "every holder maps the table read-only"
    return {inode for inode, _ in maps}


def _broker_pid(ckpt, timeout: float) -> int | None:
    """The pid serving the table's broker name, once someone alive does (within `timeout`)."""
    (source,) = spec_for(ckpt, max_tokens=8).sources
    name = broker_name(fingerprint(locate_tensor(source), source.table))
    deadline = time.monotonic() + timeout
    while (pid := name_holder(name)[0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid


def _settled_shmem(tol: int = 1 << 20, timeout: float = 15.0) -> int:
    """Shmem once it stops moving: the previous module's engines may still be going."""
    deadline, last = time.monotonic() + timeout, shmem_bytes()
    while time.monotonic() < deadline:
        time.sleep(1)
        now = shmem_bytes()
        if abs(now - last) <= tol:
            return now
        last = now
    return last


def _wait_shmem(target: int, tol: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = shmem_bytes()
        if abs(now - target) < tol:
            return now
        time.sleep(0.2)
    return shmem_bytes()


def test_holders_share_one_copy_and_the_last_frees_it(tmp_path):
    path = tmp_path / "ckpt"
    write_checkpoint(path, rows=ROWS, layers=LAYERS, ple_dim=DIM)
    table = ROWS * LAYERS * DIM * 2
    base = _settled_shmem()  # shmem pages (ple.huge_pages off): what Shmem counts
    a, _, a_conn = start_offload(spec_for(path, max_tokens=8, rank=0, huge_pages="off"))
    after_one = shmem_bytes()
    b, _, b_conn = start_offload(spec_for(path, max_tokens=8, rank=1, huge_pages="off"))
    after_two = shmem_bytes()
    assert after_one - base > 0.9 * table, "the first holder loads the table"
    assert after_two - after_one < 0.1 * table, "the second holder shares it"
    assert _table_inode(a.pid) == _table_inode(b.pid) and _table_inode(a.pid)

    os.kill(a.pid, 9)  # the loader dies; the copy stays with b and is still served
    a.join(5)
    assert _broker_pid(path, timeout=5.0) == b.pid, "a holder takes the broker name over"
    c, _, c_conn = start_offload(spec_for(path, max_tokens=8, rank=2, huge_pages="off"))
    assert _table_inode(c.pid) == _table_inode(b.pid)
    assert shmem_bytes() - after_two < 0.1 * table

    for proc, conn in ((b, b_conn), (c, c_conn)):
        conn.send("stop")
        proc.join(10)
    assert _wait_shmem(base, 0.1 * table) - base < 0.1 * table, "freed with its last holder"
    assert ple_shm_entries() == []


def test_a_kill_while_a_segment_is_reserved_leaves_nothing():
    """The segment never has a name, even while its memory is being reserved (fallocate)."""
    # the kill comes 0.2 s in: a reservation of up to 8 GiB (half the free /dev/shm at most)
    # takes longer than that on every machine seen (about 0.8 s at 10 GiB/s), and only what
    # was reserved by the kill is ever held
    st = os.statvfs("/dev/shm")
    size = min(8 << 30, st.f_bavail * st.f_frsize // 2)
    base = shmem_bytes()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, b"s")
            SharedSegment.create("pair", size)
            os.write(w, b"d")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"s"
    time.sleep(0.2)
    still_reserving = not select.select([r], [], [], 0)[0]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    assert still_reserving, "the kill came after the reservation: the row proves nothing"
    assert ple_shm_entries() == []
    assert _wait_shmem(base, 64 << 20) - base < 64 << 20, "the memory went with its holder"


def _page_kib(pid: int) -> set[int]:
    """KernelPageSize (KiB) of the node table's mappings in a process (its memfd's)."""
    sizes, table = set(), False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                table = "memfd:ray-ple-table" in line
            elif table and line.startswith("KernelPageSize:"):
                sizes.add(int(head[1]))
    return sizes


def test_the_node_table_on_huge_pages_is_shared_served_and_freed(tmp_path, huge_pool):
    """`huge_pages: require` with a pool that holds the table: one copy on 2 MiB pages,
    shared by a second holder (which checks the fd's size against its own), rows exact,
    every page back in the pool once the holders are gone."""
    path = tmp_path / "ckpt"
    table = write_checkpoint(path, rows=ROWS, layers=LAYERS, ple_dim=DIM)
    free, page = hugetlb_pool()
    need = -(-(ROWS * LAYERS * DIM * 2 + 4096) // page)
    if huge_pool(need + 4) < need:
        pytest.skip("the host gave the pool fewer huge pages than the table needs")
    free = hugetlb_pool()[0]
    a, handle, a_conn = start_offload(spec_for(path, max_tokens=64, rank=0,
                                               huge_pages="require"))
    b, _, b_conn = start_offload(spec_for(path, max_tokens=64, rank=1, huge_pages="require"))
    assert free - hugetlb_pool()[0] == need, "one copy, from the pool"
    assert _page_kib(a.pid) == _page_kib(b.pid) == {page >> 10}
    assert _table_inode(a.pid) == _table_inode(b.pid)
    rng = np.random.default_rng(3)
    steps = [rng.integers(-3, ROWS + 3, size=int(rng.integers(1, 65))).tolist()
             for _ in range(200)]
    spec = spec_for(path, max_tokens=64)
    wproc, wconn = start_worker(handle, spec.geometry, steps, table, tmp_path)
    assert wconn.recv() == ("done", 0), "every row of every step is the checkpoint's"
    wconn.send("stop")
    wproc.join(10)
    for proc, conn in ((a, a_conn), (b, b_conn)):
        conn.send("stop")
        proc.join(10)
    deadline = time.monotonic() + 10
    while hugetlb_pool()[0] != free and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hugetlb_pool()[0] == free, "freed with its last holder"
    assert ple_shm_entries() == []


def test_a_pool_too_small_is_one_error_for_require_and_4k_pages_for_auto(tmp_path,
                                                                          huge_pool):
    path = tmp_path / "ckpt"
    write_checkpoint(path, rows=ROWS, layers=LAYERS, ple_dim=DIM)
    huge_pool(1)  # one free page: the table needs 33
    free = hugetlb_pool()[0]
    base = shmem_bytes()
    with pytest.raises(RuntimeError, match="hugetlb pool cannot hold the ray-ple table"):
        start_offload(spec_for(path, max_tokens=8, huge_pages="require"))
    assert hugetlb_pool()[0] == free and ple_shm_entries() == []
    assert _wait_shmem(base, 16 << 20) - base < 16 << 20, "nothing reserved was kept"
    a, _, a_conn = start_offload(spec_for(path, max_tokens=8, huge_pages="auto"))
    assert _page_kib(a.pid) == {4} and hugetlb_pool()[0] == free
    # the node's copy is on 4 KiB pages now: a holder that requires huge pages refuses it
    with pytest.raises(RuntimeError, match="'require' but the node's copy"):
        start_offload(spec_for(path, max_tokens=8, rank=1, huge_pages="require"))
    a_conn.send("stop")
    a.join(10)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_auto_takes_a_pool_that_holds_the_table_and_off_never(tmp_path, huge_pool, mode):
    path = tmp_path / "ckpt"
    write_checkpoint(path, rows=ROWS, layers=LAYERS, ple_dim=DIM)
    page = hugetlb_pool()[1]
    need = -(-(ROWS * LAYERS * DIM * 2 + 4096) // page)
    if (got := huge_pool(need)) < need:
        pytest.skip("the host gave the pool fewer huge pages than the table needs")
    a, _, a_conn = start_offload(spec_for(path, max_tokens=8, huge_pages=mode))
    on_pool = mode == "auto"
    assert _page_kib(a.pid) == ({page >> 10} if on_pool else {4})
    assert hugetlb_pool()[0] == (got - need if on_pool else got)
    a_conn.send("stop")
    a.join(10)


def test_seal_waits_out_a_transient_pin_and_names_one_that_stays(monkeypatch):
    """A page of the file with an extra reference makes the kernel refuse the write seal
    (EBUSY): here a real one, a page of the segment spliced into a pipe. A pin that goes
    (the pipe drained) is waited out; one that stays is one clear error at the bound."""
    import fcntl
    import threading

    from ray_ple.errors import PleShmError
    from ray_ple.offload import table_segment

    def pinned_segment() -> tuple[TableSegment, int]:
        seg = TableSegment.create("t", 1 << 20)
        seg.map[:4096] = b"r" * 4096
        r, w = os.pipe()
        assert os.splice(seg.fd, w, 4096, offset_src=0) == 4096  # the pipe holds the page
        os.close(w)
        return seg, r

    seg, r = pinned_segment()
    drain = threading.Timer(0.5, lambda: os.read(r, 4096))
    drain.start()
    t0 = time.monotonic()
    seg.seal()
    assert time.monotonic() - t0 >= 0.4, "sealed while the page was still pinned"
    assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & table_segment.SEALS == table_segment.SEALS
    drain.join()
    os.close(r)
    seg.close()

    monkeypatch.setattr(table_segment, "SEAL_WAIT_S", 0.3)
    seg, r = pinned_segment()
    with pytest.raises(PleShmError, match="cannot seal the segment: .*busy"):
        seg.seal()
    os.close(r)
    seg.close()
    assert ple_shm_entries() == []


def _two_checkpoints(tmp_path) -> tuple:
    """A served checkpoint and another of the same shape with other rows."""
    path, other = tmp_path / "ckpt", tmp_path / "other"
    old = write_checkpoint(path, rows=4096, seed=0)
    new = write_checkpoint(other, rows=4096, seed=1)
    assert (old != new).any(axis=1).all()
    (source,) = spec_for(path, max_tokens=8).sources
    return path, other, source, old, new


def _load_into_segment(table: TableFile, source) -> np.ndarray:  # noqa: ANN001
    """The loader's own steps after the fingerprint: a new segment, `load_rows` through the fd."""
    layer = source.table
    seg = TableSegment.create("table", PAGE + layer.table_bytes)
    try:
        load_rows(seg, table, layer, table.fingerprint(layer))
        return np.ndarray((layer.rows, layer.row_bytes), np.uint8, seg.map, PAGE).copy()
    finally:
        seg.close()


def test_a_checkpoint_replaced_after_its_header_was_read_is_one_error_never_its_rows(tmp_path):
    """The header, the fingerprint and the rows come through one fd, so a file put on the
    path between the header read and the load is never read under the old fingerprint; the
    opened file lost its name meanwhile (its ctime moved), so the load is refused as one
    error. Asked again, the new file is served whole under its own fingerprint."""
    path, other, source, _, new = _two_checkpoints(tmp_path)
    with TableFile.open(source) as table:
        fp = table.fingerprint(source.table)
        os.replace(other / "model.safetensors", path / "model.safetensors")
        with pytest.raises(PleModelError, match="changed while its table"):
            _load_into_segment(table, source)
    assert ple_shm_entries() == []
    served = acquire_table(source, shm_dir="/dev/shm", deadline_s=30, huge_pages="off")
    try:
        assert served.fingerprint != fp and (served.rows == new).all()
    finally:
        served.close()


def test_a_checkpoint_rewritten_in_place_before_the_load_ends_is_refused(tmp_path):
    """Same inode, other rows written between the fingerprint and the end of the load: the
    fstat after the load differs from the one the fingerprint was made of, so the rows are
    refused with one error, never served as a mix under the old fingerprint."""
    path, _, source, _, new = _two_checkpoints(tmp_path)
    with TableFile.open(source) as table:
        loc = table.loc
        with open(path / "model.safetensors", "r+b") as f:  # same inode, half the rows new
            f.seek(loc.begin)
            f.write(new[: len(new) // 2].tobytes())
        with pytest.raises(PleModelError, match="changed while its table"):
            _load_into_segment(table, source)
    assert ple_shm_entries() == []
