"""Fixtures for the real-client end-to-end test: two simulated vLLM engines and the
router in front of them, all debug binaries that `cargo test --workspace` builds, on
127.0.0.1. Everything started here is stopped at the end of the session.

Binaries are looked up in `$CARGO_TARGET_DIR/debug` (default: `target/debug` of this
repository); `SDK_TEST_BIN_DIR` overrides the folder.
"""

import os
import select
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 20.0


def bin_dir() -> Path:
    if os.environ.get("SDK_TEST_BIN_DIR"):
        return Path(os.environ["SDK_TEST_BIN_DIR"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    if not target.is_absolute():
        target = REPO / target
    return target / "debug"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `cargo test --workspace` (or cargo build --workspace) first")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """First stdout line of `proc`, waiting at most `timeout_s`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError("no output")
    return proc.stdout.readline().decode().strip()


def start_engine(name: str, logs: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`sim-engine --port 0`: the bound URL is the last word of its first line."""
    proc = subprocess.Popen(
        [str(binary("sim-engine")), "--port", "0", "--name", name, "--time-factor", "0.01", *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=open(logs / f"{name}.err", "wb"),
    )
    line = read_line(proc, STARTUP_TIMEOUT_S)
    assert line.startswith(f"sim-engine {name} listening on http://"), line
    return proc, line.rsplit(" ", 1)[1]


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    return False


def start_router(workers: list[str], logs: Path) -> tuple[subprocess.Popen, str]:
    """The router on a free port (retried if another process takes it first)."""
    for _ in range(3):
        port = free_port()
        config = logs / "router.yaml"
        config.write_text(
            "server:\n  host: 127.0.0.1\n  port: %d\n  shutdown_grace_secs: 1\n"
            "workers:\n%s"
            "health:\n  interval_secs: 1\n"
            "log:\n  level: warn\n" % (port, "".join(f"  - url: {w}\n" for w in workers))
        )
        log = open(logs / "router.log", "wb")
        proc = subprocess.Popen(
            [str(binary("cache-aware-router")), "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        if wait_healthy(url, proc, time.monotonic() + STARTUP_TIMEOUT_S):
            return proc, url
        stop(proc)
    pytest.fail("router did not become healthy:\n" + (logs / "router.log").read_text()[-3000:])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def two_engines_and_a_router(names: tuple[str, str], *engine_args: str):
    """{"router": URL, "engines": [URL, URL]}, stopped when the generator ends."""
    procs = []
    with tempfile.TemporaryDirectory(prefix="sdk-e2e-") as tmp:
        logs = Path(tmp)
        try:
            engines = []
            for name in names:
                proc, url = start_engine(name, logs, *engine_args)
                procs.append(proc)
                engines.append(url)
            router, url = start_router(engines, logs)
            procs.append(router)
            yield {"router": url, "engines": engines}
        finally:
            for proc in reversed(procs):
                stop(proc)


@pytest.fixture(scope="session")
def stack():
    """Two engines behind the router."""
    yield from two_engines_and_a_router(("sdk-a", "sdk-b"))


@pytest.fixture(scope="session")
def dying_stack():
    """Two engines that cut every fresh streamed answer after 3 tokens (a continuation
    of a partial answer is served whole), behind the router."""
    yield from two_engines_and_a_router(("sdk-c", "sdk-d"), "--die-after-tokens", "3")
