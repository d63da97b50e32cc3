"""What the HTTP guard costs the server, counted in instructions: the noise-free twin of ``asgi_overhead.py``.

Each variant of ``asgi_overhead.py`` (the same apps, policy and request) is served by uvicorn under valgrind's
callgrind, with instrumentation off while it starts and warms up; then instrumentation goes on, ``REQUESTS`` requests
are sent over loopback, and the server's user-space instructions are read back. Instructions per request repeat to
within about 0.5 % from run to run whatever else the machine is doing (loopback throughput on a small shared VM
moves by +-30 % from round to round), so a change to the hot path shows up here as a number, not as a trend in the
noise. ``bare / variant`` is the throughput a CPU-bound server would keep if every instruction cost the same; the real
ratio is lower where the guard's code runs at a lower rate than the server's own (cache and branch-predictor misses:
its code and data are cold again after each request's trip through uvicorn), which only the loopback run measures.

The proxy variants (``proxy``, ``forward``: the forwarding alone, no guard; ``base-proxy`` with ``--baseline``)
count the proxy's own process, its upstream (a bare app of its own) running outside callgrind: ``proxy - bare`` is
what the proxy's front costs beyond a bare app, with the upstream's own cost not in it.

Needs valgrind (``apt-get install valgrind``). A variant takes about 20 s (callgrind runs the server ~50x slower).

Run:  python bench/asgi_instructions.py [--requests 1000] [--baseline DIR] [--variants bare,guarded-mem,proxy,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asgi_overhead import POLICY, ROOT, _free_port, _run, _start  # the variants are asgi_overhead's

# Settings -----------------------------------------------------------------------------------------------------------
REQUESTS = 1000  # counted requests per variant (concurrency 4)
WARMUP = 400  # requests before counting starts (fill the cache, specialise the interpreter's bytecode)
VARIANTS = ("bare", "guarded-mem", "passthrough", "base-mem", "proxy", "forward", "base-proxy")
PROXY_VARIANTS = ("proxy", "forward", "base-proxy")


def count(variant: str, requests: int, policy_file: str, package_root: Path) -> float:
    """Instructions per request of ``variant``'s server (user space: the interpreter, the C libraries, no kernel)."""
    serve_as = {"passthrough": "guarded-mem", "base-mem": "guarded-mem"}.get(variant, variant)
    path = "/open/echo" if variant == "passthrough" else "/v1/echo"
    port = _free_port()
    upstream = None
    with tempfile.TemporaryDirectory() as out:
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/callgrind.%p",
                sys.executable, str(ROOT / "bench" / "asgi_overhead.py"), "--serve", serve_as, "--port", str(port),
                "--policy-file", policy_file]  # fmt: skip
        if variant in PROXY_VARIANTS:  # the proxy is counted; its upstream (a bare app) runs outside callgrind
            upstream, upstream_port = _start("bare", None, None, policy_file)
            argv += ["--upstream", f"http://127.0.0.1:{upstream_port}"]
        env = {**os.environ, "PYTHONPATH": str(package_root), "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(argv, cwd=package_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"{variant}: the server under callgrind did not start") from None
                    time.sleep(0.5)
            asyncio.run(_run(port, path, WARMUP, 4))
            subprocess.run(["callgrind_control", "--instr=on", str(proc.pid)], check=True, capture_output=True)
            asyncio.run(_run(port, path, requests, 4))
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], check=True, capture_output=True)
        finally:
            proc.terminate()
            proc.wait(60)
            if upstream is not None:
                upstream.terminate()
                upstream.wait(10)
        total = 0
        for dump in Path(out).glob("callgrind.*"):
            for line in dump.read_text().splitlines():
                if line.startswith("summary:"):
                    total += int(line.split()[1])
    return total / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of guard to compare (base-mem, base-proxy)")
    parser.add_argument("--variants", default="bare,guarded-mem,passthrough,base-mem",
                        help=f"comma-separated subset of {','.join(VARIANTS)} (bare is always counted)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("needs valgrind and callgrind_control on PATH (apt-get install valgrind)")
    wanted = {v.strip() for v in args.variants.split(",")} | {"bare"}
    variants = [v for v in VARIANTS if v in wanted and (not v.startswith("base-") or args.baseline is not None)]
    policy_file = ROOT / "bench" / ".asgi_instructions_policy.yaml"
    policy_file.write_text(POLICY)
    try:
        counts = {}
        for variant in variants:
            root = args.baseline.resolve() if variant.startswith("base-") else ROOT
            counts[variant] = count(variant, args.requests, str(policy_file), root)
    finally:
        policy_file.unlink(missing_ok=True)
    bare = counts["bare"]
    print(f"server instructions per request ({args.requests} requests after {WARMUP} warm-up; user space, callgrind)")
    print(f"{'variant':<14} {'instructions':>13} {'+ vs bare':>11} {'bare / variant':>15}")
    for variant, value in counts.items():
        print(f"{variant:<14} {value:13,.0f} {value - bare:+11,.0f} {bare / value:15.1%}")


if __name__ == "__main__":
    main()
