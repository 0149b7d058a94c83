"""The process and file helpers on the floor that two stages share: the pid lock of a folder
(the broker's data dir, the proxy's event buffer) and stopping a child's process group (the
demo's simulator, the stages' launchers)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from pipeline.files import lock_with_pid
from pipeline.procutil import stop_group


def test_a_pid_lock_is_held_by_one_holder_at_a_time_and_names_it(tmp_path):
    fd, holder = lock_with_pid(tmp_path / "LOCK")
    assert fd is not None and holder == ""
    try:
        again, holder = lock_with_pid(tmp_path / "LOCK")  # another open file description: refused
        assert again is None and holder == str(os.getpid())
    finally:
        os.close(fd)
    fd, _ = lock_with_pid(tmp_path / "LOCK")  # released with its descriptor
    assert fd is not None
    os.close(fd)


def test_stop_group_terminates_and_kills_what_ignores_sigterm():
    polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
    assert stop_group(polite, 10) == -signal.SIGTERM
    deaf = subprocess.Popen(["bash", "-c", "trap '' TERM; echo deaf; sleep 60 & wait"], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert deaf.stdout.readline() == "deaf\n"  # SIGTERM is ignored from here on
    t0 = time.monotonic()
    assert stop_group(deaf, 0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    assert stop_group(deaf, 0.5) == -signal.SIGKILL  # already gone: not an error
    deaf.stdout.close()


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    """An outgoing connection is never given a port free_port handed out (the race that made a
    stage's bind fail with 'address already in use' while clients connected elsewhere)."""
    from pipeline.procutil import _ephemeral_low, free_port, port_free

    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(p < low for p in ports) and all(port_free(p) for p in ports[:10])
    assert len(set(ports)) > 40  # drawn at random, not one port again and again
    assert _ephemeral_low("/nonexistent") == 32768
