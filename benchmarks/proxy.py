"""What the proxy costs: straight to the server vs through slotkeeper, on loopback, in one run.

Prints (medians over --repeat runs, direct and proxied runs alternating):
  1. small requests, POST /tokenize over 32 keep-alive connections: req/s direct, proxied and their ratio
     (target >= 0.6), against a real llama-server and against the stub (the pure proxy cost);
  2. p50 latency of the same request over 1 connection, and what slotkeeper adds (target <= 0.25 ms);
  3. SSE: tokens/s of one streamed completion as the client receives them, direct vs proxied, on the real
     server (target ratio >= 0.98), and the ceiling in events/s with the stub generating as fast as it can;
  4. a 1 GiB request body streamed through slotkeeper to a sink child: slotkeeper's peak RSS (VmHWM from
     /proc/<pid>/status; target <= 80 MB) and the throughput;
  5. 256 concurrent streamed completions through slotkeeper: errors (target 0), on the real server (which
     queues them on its slots) and on the stub with 256 slots (all streaming at once).

The load generator for 1 and 2 is wrk, in its own process (Debian/Ubuntu: `apt-get install wrk`). Without it
(or with --python-loadgen) a uvloop load generator runs in its own process instead; the output says which ran.
It also prints slotkeeper's CPU time per request and per SSE event, which depends less on what else the
machine is doing than the rates do. Everything listens on 127.0.0.1 and every process started is killed.

    uv run python benchmarks/proxy.py [--repeat 3] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

TOKENIZE_BODY = '{"content":"Hello world, this is a small tokenize request."}'
MB = 1024 * 1024


def server_args(threads: int) -> list[str]:
    return ["-c", "8192", "-np", "1", "-t", str(threads), "--no-warmup"]


# ---- the sink child: enough of llama-server for slotkeeper to become ready, plus POST /sink ----------------


def sink_child(argv: list[str]) -> None:
    """`--sink-child <llama-server args>`: answers /health, /props, /slots; POST /sink counts and drops the body."""
    import uvloop
    from aiohttp import web

    host = argv[argv.index("--host") + 1]

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(_request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 1, "default_generation_settings": {"n_ctx": 0}})

    async def slots(_request: web.Request) -> web.Response:
        return web.json_response([])

    async def sink(request: web.Request) -> web.Response:
        total = 0
        async for data in request.content.iter_any():
            total += len(data)
        return web.json_response({"bytes": total})

    async def main() -> None:
        app = web.Application(client_max_size=0)
        app.router.add_get("/health", health)
        app.router.add_get("/props", props)
        app.router.add_get("/slots", slots)
        app.router.add_post("/sink", sink)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, host).start()
        await asyncio.Event().wait()

    uvloop.run(main())


# ---- load generation -----------------------------------------------------------------------------------------


def wrk_run(port: int, connections: int, seconds: float, script: Path) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}/tokenize",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"\s50%\s+([\d.]+)(us|ms|s)\b", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return {
        "rps": rate,
        "p50_ms": float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan"),
        "errors": errors,
        "requests": requests,
    }


def byte_pipe(argv: list[str]) -> None:
    """`--byte-pipe LISTEN_PORT UPSTREAM_PORT`: the floor for any proxy in Python. Each client connection gets its
    own upstream connection and bytes are copied both ways, with no HTTP parsing at all (so none of the proxy's
    duties: no gate, no header rules, no pooling)."""
    import uvloop

    listen_port, upstream_port = int(argv[0]), int(argv[1])

    class Upstream(asyncio.Protocol):
        def __init__(self, client: Client) -> None:
            self.client = client

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)

        def data_received(self, data: bytes) -> None:
            self.client.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.transport.close()

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = cast(asyncio.Transport, transport)
            self.pending: list[bytes] = []
            self.upstream: Upstream | None = None
            self.connecting = asyncio.ensure_future(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            _, self.upstream = await loop.create_connection(lambda: Upstream(self), "127.0.0.1", upstream_port)
            for data in self.pending:
                self.upstream.transport.write(data)

        def data_received(self, data: bytes) -> None:
            if self.upstream is None:
                self.pending.append(data)
            else:
                self.upstream.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.upstream is not None:
                self.upstream.transport.close()

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Client, "127.0.0.1", listen_port)
        await asyncio.Event().wait()

    uvloop.run(main())


def python_loadgen(argv: list[str]) -> None:
    """`--loadgen PORT CONNECTIONS SECONDS`: keep-alive POST /tokenize loops; prints a JSON summary."""
    import uvloop

    port, connections, seconds = int(argv[0]), int(argv[1]), float(argv[2])
    body = TOKENIZE_BODY.encode()
    request = (
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    latencies: list[float] = []
    errors = 0

    async def worker(deadline: float) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if not head.startswith(b"HTTP/1.1 200"):
                errors += 1
            if re.search(rb"(?i)connection:\s*close", head):  # llama-server: every 100th answer on a connection
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()

    async def main() -> None:
        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(worker(deadline) for _ in range(connections)))

    started = time.perf_counter()
    uvloop.run(main())
    elapsed = time.perf_counter() - started
    print(
        json.dumps(
            {
                "rps": len(latencies) / elapsed,
                "p50_ms": statistics.median(latencies) * 1e3,
                "errors": errors,
                "requests": len(latencies),
            }
        )
    )


USE_WRK = bool(shutil.which("wrk"))


def load(port: int, connections: int, seconds: float, script: Path) -> dict[str, float]:
    if USE_WRK:
        return wrk_run(port, connections, seconds, script)
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen", str(port), str(connections), str(seconds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    return json.loads(out)


# ---- streaming ------------------------------------------------------------------------------------------------


def stream_rate(port: int, body: dict[str, Any]) -> tuple[float, int]:
    """(events/s between the first and the last event, events) of one streamed /completion."""
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(
            b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        first = last = 0.0
        events = 0
        tail = head = b""
        while data := sock.recv(262144):
            head = head or data
            now = time.perf_counter()
            n = (tail + data).count(b"data: ")
            tail = data[-5:]
            if n:
                if not events:
                    first = now
                events += n
                last = now
        if not events:
            print(f"no events from port {port}: {head[:300]!r}", file=sys.stderr)
    return (events - 1) / (last - first) if events > 1 and last > first else 0.0, events


async def many_streams(port: int, n: int, body: dict[str, Any]) -> tuple[int, float]:
    """(errors, seconds) of `n` streamed completions started at once, each on its own connection."""
    payload = json.dumps({**body, "stream": True}).encode()
    request = (
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )

    async def one() -> bool:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            data = await asyncio.wait_for(reader.read(-1), 300)
            writer.close()
        except (OSError, TimeoutError) as exc:
            print(f"failed stream: {exc!r}", file=sys.stderr)
            return False
        head, _, body = data.partition(b"\r\n\r\n")
        complete = body.endswith(b"0\r\n\r\n") if b"chunked" in head.lower() else False
        ok = head.startswith(b"HTTP/1.1 200") and b'"stop":true' in body and complete
        if not ok:
            print(f"failed stream: {head[:200]!r} ... {body[-200:]!r}", file=sys.stderr)
        return ok

    started = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    return results.count(False), time.perf_counter() - started


# ---- processes ------------------------------------------------------------------------------------------------


def wait_healthy(port: int, timeout: float = 120) -> None:
    from slotkeeper.testing.harness import http_call, wait_until

    def ok() -> bool:
        try:
            return http_call(port, "GET", "/health", timeout=2).status == 200
        except OSError:
            return False

    if not wait_until(ok, timeout, interval=0.02):
        raise SystemExit(f"nothing healthy on port {port} after {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (load-independent, unlike rates on a shared machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sink-child":
        return sink_child(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--byte-pipe":
        return byte_pipe(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        return python_loadgen(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--body-gib", type=float, default=1.0, help="size of the big request body")
    parser.add_argument("--python-loadgen", action="store_true", help="use the Python load generator, not wrk")
    parser.add_argument("--parts", default="1,3,4,5", help="which measurements to run (1 includes 2): e.g. 1 or 3,5")
    ns = parser.parse_args()
    global USE_WRK
    USE_WRK = USE_WRK and not ns.python_loadgen

    from slotkeeper.cmdline import find_llama_server
    from slotkeeper.testing.harness import Slotkeeper, free_port

    STUB_COMMAND = f"{sys.executable} {Path(__file__).resolve().parent.parent / 'tests' / 'stub.py'}"
    from slotkeeper.testing.tinymodel import TinyModelSpec, write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-proxy-"))
    procs: list[subprocess.Popen[bytes]] = []
    keepers: list[Slotkeeper] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "SLOTKEEPER_", "STUB_"))}
    env["XDG_CACHE_HOME"] = str(work / "xdg")

    def plain(command: list[str], extra_env: dict[str, str] | None = None) -> int:
        port = free_port()
        procs.append(
            subprocess.Popen(
                [*command, "--host", "127.0.0.1", "--port", str(port)],
                env={**env, **(extra_env or {})},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_healthy(port)
        return port

    def keeper(server: str, args: list[str], extra_env: dict[str, str] | None = None) -> Slotkeeper:
        port = free_port()
        name = f"sk{len(keepers)}"
        sk = Slotkeeper(
            [*args, "--port", str(port), "--slot-save-path", str(work / name)],
            {**env, "LLAMA_SERVER": server, **(extra_env or {})},
            work,
            port,
            work / f"{name}.log",
        )
        keepers.append(sk.start())
        sk.wait_ready(120)
        return sk

    try:
        binary = find_llama_server(None, os.environ)[0]
        model = write_tiny_model(work / "tiny.gguf", TinyModelSpec(seed=1))
        script = work / "tokenize.lua"
        script.write_text(
            f'wrk.method = "POST"\nwrk.body = \'{TOKENIZE_BODY}\'\nwrk.headers["Content-Type"] = "application/json"\n'
        )
        missing = " (wrk not found; for reference numbers: apt-get install wrk)"
        generator = "wrk" if USE_WRK else "python" + (" (--python-loadgen)" if shutil.which("wrk") else missing)
        print(f"load generator: {generator}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}")

        llama_args = ["-m", str(model), *server_args(2)]
        direct = plain([binary, *llama_args])
        proxied_sk = keeper(binary, llama_args)
        proxied = proxied_sk.port
        stub_env = {"STUB_LOAD_SECONDS": "0", "STUB_TOKEN_SECONDS": "0"}
        stub_direct = plain([*STUB_COMMAND.split(), "-m", "stub.gguf", "-np", "1"], stub_env)
        stub_sk = keeper(STUB_COMMAND, ["-m", "stub.gguf", "-np", "1"], stub_env)
        stub_proxied = stub_sk.port

        if "1" in ns.parts:
            # 1 and 2: small requests
            for label, d_port, sk in (("llama-server", direct, proxied_sk), ("stub", stub_direct, stub_sk)):
                p_port = sk.port
                rates: dict[str, list[float]] = {"direct": [], "proxied": []}
                p50s: dict[str, list[float]] = {"direct": [], "proxied": []}
                errors = 0
                cpu = requests = 0.0
                load(d_port, 32, 1, script)  # warm up both
                load(p_port, 32, 1, script)
                for _ in range(ns.repeat):
                    for kind, port in (("direct", d_port), ("proxied", p_port)):
                        before = cpu_seconds(sk.pid)
                        r = load(port, 32, ns.seconds, script)
                        if kind == "proxied":
                            cpu += cpu_seconds(sk.pid) - before
                            requests += r["requests"]
                        rates[kind].append(r["rps"])
                        errors += int(r["errors"])
                    for kind, port in (("direct", d_port), ("proxied", p_port)):
                        r = load(port, 1, max(2.0, ns.seconds / 2), script)
                        p50s[kind].append(r["p50_ms"])
                        errors += int(r["errors"])
                d, p = median(rates["direct"]), median(rates["proxied"])
                added = median([b - a for a, b in zip(p50s["direct"], p50s["proxied"])])
                print(
                    f"[1] {label:12} POST /tokenize, 32 connections: direct {d:8.0f} req/s, proxied {p:8.0f} req/s, "
                    f"ratio {p / d:.2f} (target >= 0.6)   runs: {[round(x) for x in rates['proxied']]} "
                    f"vs {[round(x) for x in rates['direct']]}; errors {errors}; slotkeeper CPU "
                    f"{cpu / requests * 1e6:.0f} us/request"
                )
                print(
                    f"[2] {label:12} p50 at 1 connection: direct {median(p50s['direct']):.3f} ms, proxied "
                    f"{median(p50s['proxied']):.3f} ms, added {added:.3f} ms (target <= 0.25 ms)"
                )
            # The floor: what copying the bytes alone costs, with no HTTP parsing (not a usable proxy).
            pipe_port = free_port()
            pipe = subprocess.Popen([sys.executable, __file__, "--byte-pipe", str(pipe_port), str(direct)])
            procs.append(pipe)
            time.sleep(1.0)
            load(pipe_port, 32, 1, script)
            ratios, cpu, requests = [], 0.0, 0.0
            for _ in range(ns.repeat):
                d = load(direct, 32, ns.seconds, script)["rps"]
                before = cpu_seconds(pipe.pid)
                r = load(pipe_port, 32, ns.seconds, script)
                cpu += cpu_seconds(pipe.pid) - before
                requests += r["requests"]
                ratios.append(r["rps"] / d)
            print(
                f"[1] byte pipe    (no HTTP parsing, 1:1 connections: the floor for a Python proxy) to llama-server: "
                f"ratio {median(ratios):.2f}, CPU {cpu / requests * 1e6:.0f} us/request"
            )

        if "3" in ns.parts:
            # 3: SSE token rate. With -t 2 llama-server wants both cores, so every CPU cycle slotkeeper spends
            # relaying an event is taken from the generation; with -t 1 a core is left for slotkeeper and the client.
            body = {"prompt": "Once upon a time", "n_predict": 2000, "temperature": 0, "cache_prompt": False}
            one_thread = ["-m", str(model), *server_args(1)]
            pairs = [("-t 2", direct, proxied_sk), ("-t 1", plain([binary, *one_thread]), keeper(binary, one_thread))]
            for label, d_port, sk in pairs:
                stream_rate(d_port, {**body, "n_predict": 64})
                ratios, d_rates, p_rates = [], [], []
                cpu = events = 0.0
                for i in range(2 * ns.repeat):  # noisier than the rest: twice the runs, alternating which goes first
                    if i % 2:
                        d_rate, d_events = stream_rate(d_port, body)
                    before = cpu_seconds(sk.pid)
                    p_rate, p_events = stream_rate(sk.port, body)
                    cpu += cpu_seconds(sk.pid) - before
                    events += p_events
                    if not i % 2:
                        d_rate, d_events = stream_rate(d_port, body)
                    d_rates.append(d_rate)
                    p_rates.append(p_rate)
                    ratios.append(p_rate / d_rate)
                    assert d_events == p_events > 1000, (d_events, p_events)
                print(
                    f"[3] llama-server {label} SSE, {body['n_predict']} tokens: "
                    f"direct {median(d_rates):.0f} tokens/s, "
                    f"proxied {median(p_rates):.0f} tokens/s, ratio {median(ratios):.3f} (target >= 0.98); runs "
                    f"{[round(r, 3) for r in ratios]}; slotkeeper CPU {cpu / events * 1e6:.0f} us/event"
                )
            stub_body = {"prompt": "x", "n_predict": 50000}
            d_rate = median([stream_rate(stub_direct, stub_body)[0] for _ in range(ns.repeat)])
            p_rate = median([stream_rate(stub_proxied, stub_body)[0] for _ in range(ns.repeat)])
            print(
                f"[3] stub SSE at full speed (STUB_TOKEN_SECONDS=0): direct {d_rate:.0f} events/s, proxied "
                f"{p_rate:.0f} events/s: slotkeeper's ceiling is at least that"
            )

        if "4" in ns.parts:
            # 4: a huge request body
            (work / "sink.gguf").write_bytes(b"sink")
            sink = keeper(f"{sys.executable} {Path(__file__).resolve()} --sink-child", ["-m", str(work / "sink.gguf")])
            size = int(ns.body_gib * 1024 * MB)
            before = vm_hwm_mb(sink.pid)
            chunk = b"x" * MB
            started = time.perf_counter()
            with socket.create_connection(("127.0.0.1", sink.port), timeout=120) as sock:
                sock.sendall(
                    b"POST /sink HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % size
                )
                sent = 0
                while sent < size:
                    sock.sendall(chunk[: min(MB, size - sent)])
                    sent += min(MB, size - sent)
                reply = b""
                while data := sock.recv(65536):
                    reply += data
            elapsed = time.perf_counter() - started
            counted = json.loads(reply.split(b"\r\n\r\n", 1)[1])["bytes"] if b"\r\n\r\n" in reply else None
            print(
                f"[4] {size / MB:.0f} MiB body through slotkeeper to a sink: sink counted {counted} bytes "
                f"({'all' if counted == size else 'NOT ALL'}), {size / MB / elapsed:.0f} MiB/s; slotkeeper VmHWM "
                f"{before:.1f} MB before, {vm_hwm_mb(sink.pid):.1f} MB after (target <= 80 MB)"
            )

        if "5" in ns.parts:
            # 5: many concurrent streams
            errors, seconds = asyncio.run(many_streams(proxied, 256, {"prompt": "Hello", "n_predict": 16}))
            print(
                f"[5] 256 concurrent streamed completions, llama-server -np 1 through slotkeeper: {errors} errors, "
                f"{seconds:.1f} s (target 0 errors)"
            )
            wide = keeper(
                STUB_COMMAND,
                ["-m", "stub.gguf", "-np", "256"],
                {"STUB_LOAD_SECONDS": "0", "STUB_TOKEN_SECONDS": "0.02"},
            )
            errors, seconds = asyncio.run(many_streams(wide.port, 256, {"prompt": "Hello", "n_predict": 50}))
            print(
                f"[5] 256 concurrent streamed completions, stub -np 256 (all at once, 50 tokens at 50/s) through "
                f"slotkeeper: {errors} errors, {seconds:.1f} s (target 0 errors)"
            )
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        for sk in keepers:
            sk.stop()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
