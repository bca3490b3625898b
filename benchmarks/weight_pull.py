"""A node pulling weights from a weight server: full snapshot vs one-version delta, per version.

The store holds bf16 versions of a synthetic model (every version stored both as a full
snapshot and as a delta; each step moves 2% of elements by one unit in the last place, the
sparsity of a real lr-1e-6 step, see weight_delta.py), or with --adam-lr the 33.6M-parameter
model of cross_region.py after real Adam steps at that lr (lr 1e-5: ~22% of elements change).
The server is a real process (`astraflow weights serve`); the client pulls into in-memory
tensors, verifying everything. Per pull: seconds, and the client's CPU time (this process's,
the server being another): on a fast link the CPU a delta pull spends decoding and applying
is what bounds it. --baseline-src DIR runs the same loopback pulls with another checkout's
client (e.g. /work/main/src) in a child process, for a before/after in one run.

Links:
  * loopback (always)
  * shaped: the server runs in a network namespace behind a veth pair with `tc netem`
    (default 300 ms RTT and a 200 Mbit/s cap) when `ip netns` is allowed (root); otherwise the
    output says why it was skipped.

    .venv/bin/python benchmarks/weight_pull.py            # 34M params (67 MB bf16), 4 versions
    .venv/bin/python benchmarks/weight_pull.py --quick    # 5M params, 2 versions
    .venv/bin/python benchmarks/weight_pull.py --adam-lr 1e-5 --baseline-src ../main/src
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from astraflow.weights.manifest import DELTA_FILE, FULL_FILE
from astraflow.weights.tensors import bits

State = dict[str, torch.Tensor]


def make_store(root: Path, params: int, versions: int) -> None:
    """Publish ``versions`` + 1 versions (full + delta each) of a synthetic bf16 model."""
    rng = np.random.default_rng(0)
    shapes = {
        "embed.weight": (params // 4,),
        "layers.weight": (params // 2,),
        "head.weight": (params - 3 * (params // 4),),
    }
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).bfloat16() for k, s in shapes.items()}
    states = [state]
    with WeightStore(root, WeightStoreConfig(full_every=1, keep=versions + 1)) as store:
        store.publish("bench", 0, state).result()
        for v in range(1, versions + 1):
            nxt = {k: t.clone() for k, t in states[-1].items()}
            for t in nxt.values():
                flat = bits(t)
                idx = rng.choice(flat.size, int(0.02 * flat.size), replace=False)
                flat[idx] += np.uint16(1)
            store.publish("bench", v, nxt).result()
            states.append(nxt)


@contextmanager
def server(root: Path, host: str, port: int, prefix: list[str]) -> Iterator[str]:
    cmd = [*prefix, sys.executable, "-m", "astraflow.cli.main", "weights", "serve"]
    cmd += ["--root", str(root), "--host", host, "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until it accepts connections
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weight server did not start: {proc.stderr}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_link(name: str, url: str, policy: str, root: Path, streams: int) -> list[dict[str, float]]:
    """Per version after the first: a full pull into empty tensors, then a delta pull from the
    version before; seconds and client CPU seconds of each (bit-exactness asserted)."""
    try:
        from astraflow.weights import kernels  # compiled once per process, before timing

        kernels.warm(wait=True)
    except ImportError:  # a baseline checkout without them
        pass
    gc.collect()  # no full collection of the imports' heap inside a timed pull
    gc.freeze()
    print(f"\n{name}  ({url}, {streams} range streams per large file)")
    print(f"  {'version':>7}{'full MB':>9}{'full s':>8}{'delta MB':>10}{'delta s':>9}"
          f"{'speedup':>9}{'delta CPU ms':>14}")  # fmt: skip
    local = WeightClient(root)
    versions = sorted(int(p.parent.name[1:]) for p in (root / policy).glob("v*/manifest.json"))
    rows = []
    with WeightClient(url, streams=streams, timeout_s=600) as client:
        for v in versions[1:]:
            node, want = local.load(policy, v - 1), local.load(policy, v)
            scratch = {k: torch.empty_like(t) for k, t in node.items()}
            full = client.pull(policy, scratch, have=None, want=v)
            cpu = time.process_time()
            delta = client.pull(policy, node, have=v - 1, want=v)
            cpu = time.process_time() - cpu
            assert delta.path == "chain" and full.path == "full"
            assert all(torch.equal(bits_t(node[k]), bits_t(want[k])) for k in node)
            rows.append({"version": v, "full_s": full.seconds, "delta_s": delta.seconds,
                         "delta_cpu_s": cpu})  # fmt: skip
            speedup = full.seconds / delta.seconds
            print(f"  {v:>7}{full.bytes / 1e6:>9.1f}{full.seconds:>8.2f}{delta.bytes / 1e6:>10.2f}"
                  f"{delta.seconds:>9.3f}{speedup:>8.1f}x{1000 * cpu:>14.0f}")  # fmt: skip
    local.close()
    cpus = sorted(r["delta_cpu_s"] for r in rows)
    print(f"  client CPU per delta pull: median {1000 * cpus[len(cpus) // 2]:.0f} ms")
    return rows


def baseline(src: str, url: str, policy: str, root: Path, streams: int) -> list[dict[str, float]]:
    """``run_link`` on loopback with the client of another checkout (``src`` first on the
    path), in a child process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = ("import json, sys, pathlib; sys.path.insert(0, sys.argv[1]); import weight_pull; "
            "rows = weight_pull.run_link('baseline client (' + sys.argv[2] + ')', sys.argv[3], "
            "sys.argv[4], pathlib.Path(sys.argv[5]), int(sys.argv[6])); "
            "print('ROWS ' + json.dumps(rows))")  # fmt: skip
    here = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", code, here, src, url, policy, str(root), str(streams)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    out = [line for line in done.stdout.splitlines() if not line.startswith("ROWS ")]
    print("\n".join(out))
    rows: list[dict[str, float]] = json.loads(done.stdout.split("ROWS ", 1)[1])
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def netns_available() -> str | None:
    """None if we may build a namespace with netem, else the reason we may not."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"afprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"'ip netns add' failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay emulation)."""
    dev = f"afq{os.getpid()}"
    subprocess.run(["ip", "link", "add", dev, "type", "dummy"], capture_output=True)
    try:
        done = subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"],
                              capture_output=True)  # fmt: skip
        return done.returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", dev], capture_output=True)


@contextmanager
def shaped_namespace(
    rtt_ms: float, rate_mbit: float, delay_ok: bool
) -> Iterator[tuple[list[str], str]]:
    """A namespace reachable at 10.203.0.2 over a veth, shaped on both ends (netem or tbf)."""
    ns, host_if, ns_if = f"afw{os.getpid()}", f"afh{os.getpid()}", f"afn{os.getpid()}"
    delay = f"{rtt_ms / 2:g}ms"
    netem = ["netem", "delay", delay, "rate", f"{rate_mbit:g}mbit"]
    if not delay_ok:  # no netem in this kernel: a token bucket caps the rate, no added delay
        netem = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", "64kb", "latency", "400ms"]
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", "10.203.0.1/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", "10.203.0.2/30", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
        ["tc", "qdisc", "add", "dev", host_if, "root", *netem],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_if, "root", *netem],
    ]  # fmt: skip
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
        yield ["ip", "netns", "exec", ns], "10.203.0.2"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5M parameters, 2 versions")
    parser.add_argument("--params", type=int, default=None, help="model size (default 34M)")
    parser.add_argument("--versions", type=int, default=None, help="delta versions (default 4)")
    parser.add_argument("--adam-lr", type=float, default=None,
                        help="33.6M-param Adam steps at this lr (not synthetic)")  # fmt: skip
    parser.add_argument("--baseline-src", default=None,
                        help="also pull on loopback with this source tree's client")  # fmt: skip
    parser.add_argument("--streams", type=int, default=4, help="range streams per large file")
    parser.add_argument("--rtt-ms", type=float, default=300.0, help="shaped link round trip")
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="shaped link bandwidth")
    args = parser.parse_args()
    params = args.params or (5_000_000 if args.quick else 34_000_000)
    versions = args.versions or (2 if args.quick else 4)
    root = Path(tempfile.mkdtemp(prefix="weight-pull-"))
    policy = "bench"
    try:
        started = time.perf_counter()
        if args.adam_lr is not None:
            from cross_region import adam_store

            policy = "policy"
            _, params = adam_store(root, args.adam_lr, versions)
        else:
            make_store(root, params, versions)
        sizes = [
            (root / policy / f"v{v:08d}" / f).stat().st_size
            for v in (1,)
            for f in (FULL_FILE, DELTA_FILE)
        ]
        print(
            f"store: {params / 1e6:.1f}M bf16 params, {versions} delta versions, full "
            f"{sizes[0] / 1e6:.1f} MB, delta {sizes[1] / 1e6:.2f} MB "
            f"({100 * sizes[1] / sizes[0]:.2f}%), built in {time.perf_counter() - started:.1f} s"
        )
        with server(root, "127.0.0.1", free_port(), []) as url:
            rows = run_link("loopback", url, policy, root, args.streams)
            if args.baseline_src:
                base = baseline(args.baseline_src, url, policy, root, args.streams)
                ratio = [
                    b["delta_cpu_s"] / r["delta_cpu_s"] for b, r in zip(base, rows, strict=True)
                ]
                print("\nclient CPU per delta pull, baseline / this checkout: "
                      + ", ".join(f"{x:.1f}x" for x in ratio))  # fmt: skip
        reason = netns_available()
        if reason is not None:
            print(f"\nshaped link: skipped ({reason})")
            return
        delay_ok = netem_available()
        title = f"shaped link: {args.rtt_ms:g} ms RTT, {args.rate_mbit:g} Mbit/s (netem)"
        if not delay_ok:
            title = (f"shaped link: {args.rate_mbit:g} Mbit/s (tbf); NO added delay: this "
                     "kernel has no netem qdisc")  # fmt: skip
        shaped = shaped_namespace(args.rtt_ms, args.rate_mbit, delay_ok)
        with shaped as (prefix, host), server(root, host, 8020, prefix) as url:
            run_link(title, url, policy, root, args.streams)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
