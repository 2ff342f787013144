"""ManagedServer against real subprocesses standing in for SGLang (no GPU here)."""

import os
import socket
import sys
import textwrap
import time

import pytest

from kimi_nvfp4.serve_check.launcher import ManagedServer, ServerLaunchError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEALTHY_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, delay, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pidfile, "w").write(str(child.pid))
    print("loading weights", flush=True)
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health_generate" else 404); self.end_headers()
        def log_message(self, *a): pass
    print("The server is fired up and ready to roll!", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _server(tmp_path, code: str, *args, timeout=20.0) -> tuple[ManagedServer, int]:
    port = _free_port()
    script = tmp_path / "fake_server.py"
    script.write_text(code)
    cmd = [sys.executable, str(script), str(port), *map(str, args)]
    return ManagedServer(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", ready_timeout_s=timeout,
                         poll_interval_s=0.1), port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ready_then_teardown_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    server, _ = _server(tmp_path, HEALTHY_SERVER, 0.3, pidfile)
    with server:
        waited = server.wait_ready()
        assert waited >= 0.3
        child = int(pidfile.read_text())
        assert _alive(child)
    assert not server.running()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "a child of the server survived teardown"
    assert "loading weights" in (tmp_path / "server.log").read_text()


def test_fatal_log_line_fails_fast_and_is_quoted(tmp_path):
    code = ("import sys, time\nprint('loading', flush=True)\n"
            "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB', flush=True)\n"
            "print('  detail line', flush=True)\ntime.sleep(60)\n")
    server, _ = _server(tmp_path, code, timeout=30)
    t0 = time.monotonic()
    with server, pytest.raises(ServerLaunchError, match="CUDA out of memory") as e:
        server.wait_ready()
    assert time.monotonic() - t0 < 10
    assert "detail line" in str(e.value)
    assert not server.running()


def test_weight_loading_error_is_fatal(tmp_path):
    code = ("import time\nprint(\"KeyError: 'model.layers.3.mlp.experts.0.w13_weight_scale'\", flush=True)\n"
            "time.sleep(60)\n")
    server, _ = _server(tmp_path, code)
    with server, pytest.raises(ServerLaunchError, match="w13_weight_scale"):
        server.wait_ready()


def test_never_healthy_times_out(tmp_path):
    server, _ = _server(tmp_path, "import time\nprint('still loading', flush=True)\ntime.sleep(60)\n", timeout=1.0)
    t0 = time.monotonic()
    with server, pytest.raises(ServerLaunchError, match="not ready after 1 s") as e:
        server.wait_ready()
    assert time.monotonic() - t0 < 5
    assert "still loading" in str(e.value)


def test_early_exit_reports_code_and_log_tail(tmp_path):
    server, _ = _server(tmp_path, "import sys\nprint('bad flag --foo', flush=True)\nsys.exit(3)\n")
    with server, pytest.raises(ServerLaunchError, match="exited with code 3") as e:
        server.wait_ready()
    assert "bad flag --foo" in str(e.value)


def test_ctrl_c_tears_down(tmp_path):
    server, _ = _server(tmp_path, "import time\ntime.sleep(60)\n")
    with pytest.raises(KeyboardInterrupt):
        with server:
            assert server.running()
            raise KeyboardInterrupt
    assert not server.running()
