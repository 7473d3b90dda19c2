"""A process forked while one of its threads holds a cache lock (a DataLoader worker started
while the read-ahead downloads a chunk) does not keep that lock: once the thread lets go, the
child and every other process of the node can take it."""

from __future__ import annotations

import os
import threading

from hp_data.cache import key_lock


def test_a_child_forked_under_a_held_lock_does_not_keep_it(tmp_path):
    base = str(tmp_path / "stripe-0")
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with key_lock(base):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    ready = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the parent's thread to let go, then take the lock
        code = 1
        try:
            os.read(ready[0], 1)
            with key_lock(base, timeout=3.0):
                code = 0
        finally:
            os._exit(code)
    release.set()
    thread.join()
    os.write(ready[1], b"x")
    with key_lock(base, timeout=3.0):  # and this process, while the child lives
        pass
    _, status = os.waitpid(pid, 0)
    for fd in ready:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
