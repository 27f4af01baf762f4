"""The threads that complete torch futures off aiodist's loop (``_torch.torch_work.Completer``)."""

from __future__ import annotations

import os
import threading
import time

from aiodist._torch import torch_work
from aiodist._torch.torch_work import Completer


def test_a_callback_that_waits_for_a_later_one_gets_a_thread_of_its_own() -> None:
    # PowerSGD's shape: a future's callback waits for a future completed after it.
    completer = Completer()
    later, finished = threading.Event(), threading.Event()

    def waits() -> None:
        if later.wait(10):
            finished.set()

    completer.submit(waits)
    completer.submit(later.set)  # every thread is busy: one more starts
    assert finished.wait(10)


def test_a_forked_child_completes_on_threads_of_its_own() -> None:
    ran = threading.Event()
    torch_work._completer.submit(ran.set)
    assert ran.wait(10)
    deadline = time.monotonic() + 10
    while not torch_work._completer._idle:  # the thread counts itself idle right after
        assert time.monotonic() < deadline
        time.sleep(0.001)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its parent's thread did not come with it
        done = threading.Event()
        torch_work._completer.submit(done.set)
        os.write(write, b"1" if done.wait(5) else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
