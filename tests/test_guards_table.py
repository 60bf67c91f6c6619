"""Guards of the node table and its memory: what a broker of our own user serves, handed-over
fds, sealing, how segments are made, huge pages, checkpoints, names another user holds; each
with a test that fails without it (docs/mutation.md).

Every row reaches one check through the real code path, with real parts: a pair segment in
shared memory and the side that breaks the rule in a forked child (`run_side`), the
project's offload actor and worker in spawned processes (`tests.rig`), a broker in a forked
child that serves a real sealed memfd (`tests.test_squatter.squatter`). Each was seen failing
with its check removed (`scripts/mutation_pass.py` applies that to a copy of the tree).
"""

from __future__ import annotations

import fcntl
import os
import time

import pytest

from ray_ple.errors import PleEnvironmentError, PleModelError, PleShmError
from ray_ple.offload.table_segment import SEALS, TableSegment
from ray_ple.offload.table_store import _HDR, _MAGIC, acquire_table
from ray_ple.protocol.shm import PAGE, SharedSegment
from ray_ple.table_source import TableSource
from tests.leftovers import ple_shm_entries
from tests.rig import spec_for, write_checkpoint
from tests.test_squatter import (
    NOBODY,
    ROOT_ONLY,
    _held_memfds,
    _mapped_memfds,
    _names,
    _serve,
    squatter,
)


# The node table: what a broker of our own user serves is still checked ----------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory) -> TableSource:
    path = tmp_path_factory.mktemp("guards") / "ckpt"
    write_checkpoint(path, rows=512, layers=4, ple_dim=8)
    return spec_for(path, max_tokens=8).sources[0]


def _table_fd(source: TableSource, fp: str, size: int, header: dict[str, object],
              owner: int | None = None) -> int:
    """A sealed memfd of the node table's size, header from `header` (the right one where a
    field is not given; `mode` its file mode, 0600 if not), owned by `owner` (this user
    where None)."""
    mode = header.pop("mode", 0o600)
    fields = {"magic": _MAGIC, "version": 1, "ready": 1, "rows": source.table.rows,
              "row_bytes": source.table.row_bytes, "fingerprint": bytes.fromhex(fp)} | header
    fd = os.memfd_create("ray-ple-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, mode)
    os.posix_fallocate(fd, 0, size)
    page = bytearray(PAGE)
    _HDR.pack_into(page, 0, *fields.values())
    os.pwrite(fd, bytes(page), 0)
    if owner is not None:
        os.fchown(fd, owner, owner)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _refused(source: TableSource, header: dict[str, object], owner: int | None,
             error: type[Exception], match: str) -> None:
    """A broker of this user serves that fd under the right name and meta: refused, unmapped."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, _table_fd(source, fp, size, header, owner), fp, size)

    with squatter(body, uid=None):
        with pytest.raises(error, match=match):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


@ROOT_ONLY
def test_a_served_table_fd_owned_by_another_uid_is_refused(source):
    """`check_sealed`: the broker is of our user, the fd it hands over is not (a file another
    user made, passed on): sealed, 0600, the right size and header, and still refused."""
    _refused(source, {}, NOBODY, PleEnvironmentError, f"belongs to uid {NOBODY}")


def test_a_served_table_fd_readable_by_others_is_refused(source):
    """`check_sealed`: a table fd of our user whose mode lets others in (0644) is not the
    private segment a holder makes (0600), whatever else is right about it."""
    _refused(source, {"mode": 0o644}, None, PleShmError, "not a private shared-memory file")


@pytest.mark.parametrize("field,value", [
    ("magic", _MAGIC ^ 1), ("ready", 0), ("rows", 511), ("row_bytes", 32),
    ("fingerprint", bytes(32))])
def test_a_served_table_whose_header_differs_is_refused(source, field, value):
    """`acquire_table`: a sealed table of the right size from our own user whose header says
    another table (or one not fully loaded) is never mapped as this one."""
    _refused(source, {field: value}, None, PleModelError, "served by a peer does not match")


def test_a_checkpoint_of_an_unsupported_dtype_is_one_model_error(tmp_path):
    """`_engine_dtype`: a table dtype the transport cannot copy (int8 here) is one
    `PleModelError` naming it, before any geometry or segment is made from it."""
    import json

    from ray_ple.protocol.geometry import geometry_from_config, read_hf_config

    cfg = {"architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 2,
           "hidden_size_per_layer_input": 8, "vocab_size": 64, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert geometry_from_config(read_hf_config(tmp_path), max_tokens=8).tables[0].dtype \
        == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"torch_dtype": "int8"}))
    with pytest.raises(PleModelError, match="unsupported dtype 'int8'"):
        geometry_from_config(read_hf_config(tmp_path), max_tokens=8)


# Shared memory: what a handed-over fd must be, and how a segment is made and sealed ---------
def _memfd(size: int, sealed: bool) -> int:
    fd = os.memfd_create("ray-ple-guard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)
    os.posix_fallocate(fd, 0, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_a_handed_over_fd_is_refused_unless_a_sealed_private_file_of_the_size():
    """`check_sealed`: what a peer hands over must be a regular private file (not a pipe,
    whose mode is 0600 too), of exactly the size this side computed, sealed against writes
    and resizes; each is its own `PleShmError`, and the right one passes."""
    from ray_ple.offload.table_segment import check_sealed

    good = _memfd(PAGE, sealed=True)
    r, w = os.pipe()
    big, loose = _memfd(2 * PAGE, sealed=True), _memfd(PAGE, sealed=False)
    try:
        check_sealed(good, PAGE, "table")
        with pytest.raises(PleShmError, match="not a private shared-memory file"):
            check_sealed(r, PAGE, "table")
        with pytest.raises(PleShmError, match=f"holds {2 * PAGE} bytes"):
            check_sealed(big, PAGE, "table")
        with pytest.raises(PleShmError, match="not sealed against writes"):
            check_sealed(loose, PAGE, "table")
    finally:
        for fd in (good, r, w, big, loose):
            os.close(fd)


def test_a_segment_in_a_missing_directory_is_one_shm_error(tmp_path):
    """`SharedSegment.create`: a shared-memory directory that is not there (a pod without
    /dev/shm mounted) is one `PleShmError` naming it, not a bare `FileNotFoundError`."""
    with pytest.raises(PleShmError, match="does not exist"):
        SharedSegment.create("pair", PAGE, str(tmp_path / "nope"))


def test_sealing_waits_out_a_transient_pin_then_gives_up(monkeypatch):
    """`TableSegment.seal`: the kernel refuses the write seal (EBUSY) while a writable
    mapping of the file exists; a pin that goes within `SEAL_WAIT_S` is waited out, one
    that stays is one `PleShmError` at the deadline (not a wait forever), and an fd that
    cannot be sealed at all fails at once."""
    import mmap
    import threading

    from ray_ple.offload import table_segment

    monkeypatch.setattr(table_segment, "SEAL_WAIT_S", 1.0)
    seg = TableSegment.create("guard", PAGE)
    pin = mmap.mmap(seg.fd, PAGE)  # a second writable mapping: EBUSY until it goes
    timer = threading.Timer(0.3, pin.close)
    timer.start()
    try:
        seg.seal()
        assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    finally:
        timer.join()
        seg.close()
    seg = TableSegment.create("guard", PAGE)
    pin = mmap.mmap(seg.fd, PAGE)
    try:
        t0 = time.monotonic()
        with pytest.raises(PleShmError, match="cannot seal"):
            seg.seal()
        assert 0.9 < time.monotonic() - t0 < 3
    finally:
        pin.close()
        seg.close()
    tmpfs = SharedSegment.create("guard", PAGE)  # a tmpfs file, no seals at all
    seg = TableSegment(os.dup(tmpfs.fd), tmpfs.size, tmpfs.token, owner=False)
    tmpfs.close()
    try:
        t0 = time.monotonic()
        with pytest.raises(PleShmError, match="cannot seal"):
            seg.seal()
        assert time.monotonic() - t0 < 0.5
    finally:
        seg.close()


def test_a_huge_segment_on_a_host_without_hugetlb_is_one_shm_error(monkeypatch):
    """`TableSegment._create_huge`: a host with no huge page size (or a Python without
    `MFD_HUGETLB`) is one `PleShmError` saying so, not a division by a zero page size or
    a missing attribute."""
    from ray_ple.offload import table_segment

    monkeypatch.setattr(table_segment, "huge_page_size", lambda: 0)
    with pytest.raises(PleShmError, match="no hugetlb pages"):
        TableSegment.create("table", PAGE, huge=True)
    monkeypatch.setattr(table_segment, "huge_page_size", lambda: 2 << 20)
    monkeypatch.delattr(os, "MFD_HUGETLB", raising=False)
    with pytest.raises(PleShmError, match="no hugetlb pages"):
        TableSegment.create("table", PAGE, huge=True)


def test_a_segment_where_o_tmpfile_is_unsupported_falls_back_to_a_name_unlinked_at_once(
        monkeypatch):
    """`_open_nameless`: a kernel or filesystem without `O_TMPFILE` (EOPNOTSUPP) still gets
    its segment, through a 0600 file whose name is unlinked right after the open; any other
    error is the caller's."""
    import errno
    import stat

    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202 - os.open's
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported here")
        return real_open(path, flags, *args, **kwargs)

    before = set(ple_shm_entries())
    monkeypatch.setattr(os, "open", no_tmpfile)
    seg = SharedSegment.create("pair", PAGE)
    try:
        st = os.fstat(seg.fd)
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600 and st.st_nlink == 0
        assert set(ple_shm_entries()) == before, "no name is left behind"
    finally:
        seg.close()


def test_a_checkpoint_whose_table_is_not_the_configs_shape_is_refused(tmp_path):
    """`check_shape`: a PLE tensor of another shape than the model config implies (here one
    row more than `vocab_size_per_layer_input`) is one `PleModelError`: rows read at the
    config's stride from it would be other tokens' rows."""
    import json

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"vocab_size_per_layer_input": 63}))
    source = spec_for(ckpt, max_tokens=8).sources[0]
    table = None
    try:
        with pytest.raises(PleModelError, match=r"has shape \[64, 16\], the model config says"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
    finally:
        if table is not None:
            table.close()


def test_huge_pages_are_not_asked_for_where_python_cannot_ask(monkeypatch):
    """`want_huge_pages`: a Python or platform without `mmap.MADV_HUGEPAGE` gets False (the
    table is served on small pages), not an `AttributeError` that ends the load."""
    import mmap

    from ray_ple.offload.table_store import want_huge_pages

    seg = TableSegment.create("table", PAGE)
    try:
        assert want_huge_pages(seg) in (True, False)
        monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
        assert want_huge_pages(seg) is False
    finally:
        seg.close()


def test_a_checkpoint_cut_short_inside_its_table_is_refused(tmp_path):
    """A safetensors file that ends inside the PLE tensor (a copy cut short) is one
    `PleModelError` naming it, never a table whose last rows are zeros (or a load that spins
    on a read of nothing): refused by its header check before anything is made, and by
    `load_rows` when it is cut after its header was read."""
    from ray_ple.offload.table_file import TableFile
    from tests.test_table_store import _load_into_segment

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    (path,) = ckpt.glob("*.safetensors")
    source = spec_for(ckpt, max_tokens=8).sources[0]
    with TableFile.open(source) as table:  # header read whole; cut before the rows are read
        os.truncate(path, path.stat().st_size - 100)
        with pytest.raises(PleModelError, match="ends inside"):
            _load_into_segment(table, source)
    with pytest.raises(PleModelError, match="the file is truncated"):
        acquire_table(source, shm_dir="/dev/shm", deadline_s=30)


def test_a_broker_that_sends_no_fd_is_waited_out_not_a_crash(source):
    """`receive_table`: a broker of our own user whose answer carries no fd (a holder going away,
    or one that is not a holder) is "not served yet": the wait goes on to its deadline's one
    error, never an `IndexError`."""
    import json
    import socket

    from tests.test_squatter import yield_ready

    fp, name, size = _names(source)

    def body() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(name)
        sock.listen(8)
        yield_ready()
        while True:
            conn, _ = sock.accept()
            conn.sendall(json.dumps({"fingerprint": fp, "size": size}).encode())
            conn.close()

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="not available within"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=1)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


@ROOT_ONLY
def test_the_table_broker_hands_its_fd_to_no_other_uid(tmp_path):
    """`NodeTable._serve`: anyone can connect to the broker's abstract name; a client of
    another uid is let go without the table's fd (it would map our rows read-only)."""
    import socket

    from ray_ple.offload.table_broker import broker_name

    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, rows=64, layers=2, ple_dim=8)
    table = acquire_table(spec_for(ckpt, max_tokens=8).sources[0], shm_dir="/dev/shm",
                          deadline_s=30)
    try:
        name = broker_name(table.fingerprint)
        pid = os.fork()
        if pid == 0:  # the other user: how many fds did the broker hand over?
            code = 9
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                sock.connect(name)
                _, fds, _, _ = socket.recv_fds(sock, 4096, 1)
                code = len(fds)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the fd went to uid 65534"
    finally:
        table.close()


def test_a_broker_that_says_it_serves_another_table_is_refused(source):
    """`receive_table`: the broker's answer names the table it serves; one that names another
    fingerprint than the one asked for is refused before its fd is checked or mapped,
    whatever that fd holds."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, _table_fd(source, fp, size, {}), "f" * 64, size)

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="the broker serves table f{12}"):
            table = acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
            table.close()
        assert _mapped_memfds() == [] and _held_memfds() == [], "nothing of it is kept"


@ROOT_ONLY
def test_a_name_held_by_a_visible_other_uid_is_refused_after_one_refusal_window(source):
    """`_acquire`: a broker name bound, not served, by a process of another uid that this
    user can see is refused once `_REFUSED_S` of refusals has passed; only an invisible
    holder (uid unknown) waits the longer window."""
    from ray_ple.offload.table_store import _REFUSED_S

    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, -1, fp, size, listen=False)

    with squatter(body) as pid:
        t0 = time.monotonic()
        with pytest.raises(PleEnvironmentError, match=f"pid {pid} of uid {NOBODY}"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=30)
        assert time.monotonic() - t0 < 3.8 * _REFUSED_S, "refused after one window, not four"


def test_a_name_held_by_our_own_user_without_serving_is_waited_for(source):
    """`_acquire`: a broker name bound, not yet served, by a process of our own user is a
    holder still starting (or one that died bound): it is waited for up to the deadline,
    never refused as another user's."""
    fp, name, size = _names(source)

    def body() -> None:
        _serve(name, -1, fp, size, listen=False)

    with squatter(body, uid=None):
        with pytest.raises(PleModelError, match="not available within 2"):
            acquire_table(source, shm_dir="/dev/shm", deadline_s=2)
