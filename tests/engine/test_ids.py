"""Decision ids (guard/engine/ids.py): random UUID4 texts, distinct across threads and forked processes."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from guard.engine.ids import new_decision_id


def test_decision_ids_from_many_threads_are_all_distinct() -> None:
    ids: list[str] = []

    def take() -> None:
        ids.extend(new_decision_id() for _ in range(2000))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 16000 and len(set(ids)) == 16000
    assert {(uuid.UUID(i).version, uuid.UUID(i).variant) for i in ids} == {(4, uuid.RFC_4122)}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_repeats_its_parents_decision_ids() -> None:
    new_decision_id()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out without running pytest's teardown
        os.close(read_end)
        os.write(write_end, ",".join(new_decision_id() for _ in range(300)).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        child = pipe.read().decode().split(",")
    os.waitpid(pid, 0)
    parent = [new_decision_id() for _ in range(300)]
    assert len(child) == 300 and not set(child) & set(parent)
