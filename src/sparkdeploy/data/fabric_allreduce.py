#!/usr/bin/env python3
"""The fabric test's rank: an all-reduce across every node, run inside the engine's own image.

Not a node helper (those are standard library only, run by the node's python3): this program
imports the image's torch and runs in the engine's container as the engine runs (``--network
host``, the link's environment), staged by ``link.fabric`` like a helper and mounted read only.
It speaks the helpers' dialect all the same: ``progress`` lines on stdout, its report last as
one JSON line, ``error: ...`` on stderr and a non-zero exit on failure.

    python3 fabric_allreduce.py --rank R --world N --master-addr A --master-port P
        [--backend auto|gloo|nccl] --sizes B1,B2,... [--budget SECONDS] [--target SECONDS]

Each size (bytes of float32) is reduced once to warm up, then ``iters`` times, timed from a
barrier to the last rank's end; ``iters`` is chosen so that the timed loop takes about
``--target`` seconds at the warm-up's pace (the slowest rank's, so every rank agrees). The
next size is skipped (and the rest with it) when at the last size's pace it would overrun what
is left of ``--budget``, or when it would not fit in a quarter of the memory available: the
report says where and why it stopped. The report holds, per size, ``iters`` and ``seconds``
(one all-reduce, the slowest rank's mean), and the bytes every net device and RDMA port of the
node sent during the timed loops (``/sys/class/net/*/statistics/tx_bytes``,
``/sys/class/infiniband/*/ports/*/counters/port_xmit_data``, in 4-byte words): what tells the
controller which interface the collective went over.
"""

import argparse
import datetime
import glob
import json
import sys
import time

MIN_ITERS, MAX_ITERS = 1, 50


def say(text, stream=None):
    out = stream or sys.stdout
    out.write(text + "\n")
    out.flush()


def counters():
    """{"netdev": {name: tx bytes}, "rdma": {hca/port: tx bytes}} of this network namespace."""
    net, rdma = {}, {}
    for p in glob.glob("/sys/class/net/*/statistics/tx_bytes"):
        net[p.split("/")[4]] = _read_int(p)
    for p in glob.glob("/sys/class/infiniband/*/ports/*/counters/port_xmit_data"):
        parts = p.split("/")
        rdma[f"{parts[4]}/{parts[6]}"] = _read_int(p) * 4  # counted in 4-byte words
    return {"netdev": net, "rdma": rdma}


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def delta(before, after):
    return {kind: {k: max(after[kind].get(k, 0) - v, 0) for k, v in before[kind].items()}
            for kind in before}


def available_bytes():
    """MemAvailable (bytes), None when unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parse(argv):
    p = argparse.ArgumentParser(prog="fabric_allreduce.py")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--sizes", required=True, help="bytes, comma-separated, ascending")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--init-timeout", type=float, default=600.0)
    return p.parse_args(argv)


class Rank:
    def __init__(self, torch, dist, args):
        self.torch, self.dist, self.args = torch, dist, args
        self.cuda = args.backend == "nccl"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def agreed(self, value, op):
        """One float agreed by every rank (``op``: the reduction)."""
        t = self.torch.tensor([float(value)], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=op)
        return float(t.item())

    def timed(self, tensor, iters):
        self.dist.barrier()
        self.sync()
        start = time.monotonic()
        for _ in range(iters):
            self.dist.all_reduce(tensor)
        self.sync()
        return (time.monotonic() - start) / iters

    def one_size(self, size):
        """(iters, seconds per all-reduce: the slowest rank's) for ``size`` bytes."""
        torch, op = self.torch, self.dist.ReduceOp
        tensor = torch.ones(max(size // 4, 1), dtype=torch.float32, device=self.device)
        warm = self.agreed(self.timed(tensor, 1), op.MAX)
        iters = int(min(MAX_ITERS, max(MIN_ITERS, self.args.target // max(warm, 1e-9))))
        seconds = self.agreed(self.timed(tensor, iters), op.MAX)
        del tensor
        return iters, seconds, warm


def stop_before(size, last, left, avail):
    """Why the next ``size`` is not run (None: run it): it would overrun what is left of the
    budget at the last size's pace, or not fit in a quarter of the memory available."""
    if avail is not None and size * 4 > avail:
        return f"{size} bytes not run: 4x it exceeds the {avail} bytes of memory available"
    if last is not None:
        b, per = last
        need = per * size / b * 2  # the warm-up and at least one timed all-reduce
        if need > left:
            return (f"{size} bytes not run: at the last size's pace it takes about {need:.1f} s, "
                    f"{max(left, 0):.1f} s of the budget left")
    return None


def measure(rank, args, sizes):
    start = time.monotonic()
    out, last, stopped = [], None, None
    before = counters()
    for size in sizes:
        avail = available_bytes() if not rank.cuda else None
        why = stop_before(size, last, args.budget - (time.monotonic() - start), avail)
        go = rank.agreed(0.0 if why else 1.0, rank.dist.ReduceOp.MIN)  # every rank agrees
        if go < 1.0:
            stopped = why or "another rank stopped before this size"
            break
        iters, seconds, warm = rank.one_size(size)
        out.append({"bytes": size, "iters": iters, "seconds": seconds, "warmup_seconds": warm})
        say(f"progress size={size} iters={iters} seconds={seconds:.6f}")
        last = (size, seconds)
    return out, stopped, delta(before, counters())


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        say(f"error: --sizes {args.sizes!r}: not bytes", sys.stderr)
        return 2
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        say(f"error: this image's python3 cannot import torch.distributed: {e}", sys.stderr)
        return 3
    if args.backend == "auto":  # NCCL where torch sees a GPU (a Spark), else gloo (the lab's CPU build)
        args.backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if args.backend == "nccl":
        torch.cuda.set_device(0)  # one GPU per Spark: the rank's, before NCCL binds one
    began = time.monotonic()
    dist.init_process_group(args.backend, init_method=f"tcp://{args.master_addr}:{args.master_port}",
                            rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.init_timeout))
    rank = Rank(torch, dist, args)
    rank.agreed(1.0, dist.ReduceOp.SUM)  # every rank connected
    joined = time.monotonic() - began
    say(f"progress joined={args.world} seconds={joined:.3f}")
    got, stopped, moved = measure(rank, args, sizes)
    dist.destroy_process_group()
    say(json.dumps({"rank": args.rank, "world": args.world, "backend": args.backend,
                    "torch": torch.__version__, "joined_s": round(joined, 3), "sizes": got,
                    "stopped": stopped, "sent": moved}, sort_keys=True))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - a rank's failure is one line for the controller
        say(f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            sys.stderr)
        sys.exit(1)
