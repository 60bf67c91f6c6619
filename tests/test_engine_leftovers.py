"""The supervisor's inventory of what a SIGKILLed process tree leaves: real processes holding
the three kinds vLLM's engine processes hold (a `multiprocessing` shared-memory queue, a
spawn-context lock, a bound unix socket), killed with their resource tracker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from ray_ple.supervision.engine_leftovers import files_of, files_of_tree, in_use, remove_unused

HOLDER = textwrap.dedent("""
    import multiprocessing as mp, socket, sys, time
    from multiprocessing import shared_memory
    lock = mp.get_context("spawn").Lock()      # sem.mp-*: its resource tracker starts here
    queue = shared_memory.SharedMemory(create=True, size=4096)   # psm_*
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(sys.argv[1])                     # like a ZMQ ipc:// endpoint
    print("/dev/shm/sem" + lock._semlock.name.replace("/", "."), "/dev/shm/" + queue.name,
          flush=True)
    time.sleep(600)
""")


def test_a_killed_trees_semaphore_queue_and_socket_are_found_and_removed(tmp_path):
    sock_path = str(tmp_path / "engine.ipc")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, sock_path], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        sem, queue = proc.stdout.readline().split()
        files = files_of([proc.pid])
        assert {sem, queue, sock_path} <= files, files
        assert {sem, queue} <= in_use(files)
        assert remove_unused(files) == [], "nothing is removed while its holder lives"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the holder and its resource tracker
        proc.wait()
    assert os.path.exists(sem) and os.path.exists(queue) and os.path.exists(sock_path), \
        "a SIGKILLed tree leaves all three behind"
    removed = remove_unused(files)
    assert sorted(removed) == sorted({sem, queue, sock_path})
    assert not any(os.path.exists(f) for f in (sem, queue, sock_path))


def test_the_inventory_of_a_tree_reads_every_descendant(tmp_path):
    """Like vLLM's engine core under the replica: a grandchild's files are in the tree's."""
    sock_path = str(tmp_path / "core.ipc")
    parent = subprocess.Popen(["/bin/sh", "-c", 'exec 3>&1; "$0" -c "$1" "$2"; :',
                               sys.executable, HOLDER, sock_path],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        sem, queue = parent.stdout.readline().split()
        assert files_of([parent.pid]) == set(), "the parent itself holds nothing"
        assert {sem, queue, sock_path} <= files_of_tree(parent.pid)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    remove_unused({sem, queue, sock_path})
