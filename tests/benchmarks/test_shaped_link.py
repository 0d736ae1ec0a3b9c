"""The emulated link: a private network namespace whose loopback is rate-limited (where permitted), its rate
changed from inside, and one clear line where it cannot be made."""

import subprocess
import sys
import textwrap

import pytest

from benchmarks import child_env
from benchmarks.shaped_link import link_unavailable, rate_for, set_rate, shaped_command

SEND = textwrap.dedent(
    """
    import socket, threading, time
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got = []
    def sink():
        conn, _ = server.accept()
        n = 0
        while n < 1 << 21:
            n += len(conn.recv(1 << 16))
        got.append(time.perf_counter())
    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    client.sendall(b"x" * (1 << 21))
    thread.join(30)
    print(got[0] - t0)
    """
)


def _send_seconds(rate_bits: int, before: str = "") -> float:
    why = link_unavailable()
    if why is not None:
        assert why.startswith("emulated link skipped: ") and "\n" not in why
        pytest.skip(why)  # a machine without namespaces or tc: the benchmark reports this line instead
    done = subprocess.run(
        shaped_command(rate_bits, [sys.executable, "-c", before + SEND]),
        env=child_env(),  # ``before`` imports benchmarks
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


def test_the_emulated_link_runs_at_its_rate():
    """2 MiB over loopback at 32 Mbit/s takes about half a second in the namespace; without it, milliseconds."""
    assert 0.3 < _send_seconds(32_000_000) < 3.0  # 2**21 * 8 / 32e6 = 0.52 s of wire time, plus the burst


def test_the_rate_changes_from_inside():
    """A run started at 10 Gbit/s that sets 32 Mbit/s (as the benchmark does once it has measured its
    compute) then sends at 32 Mbit/s."""
    before = "from benchmarks.shaped_link import set_rate\nset_rate(32_000_000)\n"
    assert 0.3 < _send_seconds(10**10, before) < 3.0


def test_rate_and_bad_rates():
    assert rate_for(1_000_000, 0.01) == 800_000_000  # 1 MB per 10 ms of compute: 800 Mbit/s
    for bad in (0, 999, 1.5e9, "fast"):
        with pytest.raises(ValueError, match="link rate must be an integer of at least 1 Mbit/s"):
            shaped_command(bad, ["true"])
    with pytest.raises(ValueError, match="positive bytes and seconds"):
        rate_for(0, 1.0)
    with pytest.raises(ValueError, match="link rate must be an integer"):
        set_rate(True)
