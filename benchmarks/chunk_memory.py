"""Chunk memory shared by DataLoader workers (issue 54 goal 3): peak PSS of the objects, tar
and parquet readers at 2 and 4 workers.

python -m benchmarks.chunk_memory [--readers objects,tar,parquet] [--workers 2,4] [--repeats 3]

Builds 2,000 x 150 KB .npy samples (SeaweedFS on loopback) as objects, as 20 tar shards and as
20 parquet files (a binary column of the .npy bytes), then runs each reader in a fresh child
process (one at a time): RemoteDataset + npy sample cache + fastload.DataLoader(batch 32,
shuffle=True, num_workers=W), 2 epochs (cold, warm). The parent samples the child's process tree
every 50 ms: peak tree PSS, and per process the peak PSS / Private_Dirty / Private_Clean; also the
peak bytes in fastload's scratch folders in /dev/shm (not in any PSS unless mapped).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import fastload
from fastload import Cache, RemoteDataset
from fastload.stores import filesystem
from fastload.testing import SeaweedS3Server

N, SHARDS, SHAPE, BATCH = 2000, 20, (150, 250), 32
BUCKET = "probe"


def npy(i: int) -> bytes:
    out = io.BytesIO()
    np.save(out, np.random.default_rng(i).random(SHAPE, dtype=np.float32))
    return out.getvalue()


def take_npy(sample: dict[str, Any]) -> Any:
    return sample["npy"]


def parquet_row(row: dict[str, Any]) -> Any:
    return np.load(io.BytesIO(row["npy"]))


# -- child: one reader ------------------------------------------------------------------------
def child(spec: dict[str, Any]) -> None:
    options, root, reader = spec["options"], spec["root"], spec["reader"]
    cache = Cache(f"{spec['workdir']}/cache", format="npy")
    if reader == "objects":
        dataset = RemoteDataset(
            f"{root}/objects", decode="npy", cache=cache, storage_options=options
        )
    elif reader == "tar":  # source objects where this fastload has them, else shards=
        tar = fastload.Tar(f"{root}/tar") if hasattr(fastload, "Tar") else f"{root}/tar"
        more = {} if hasattr(fastload, "Tar") else {"shards": "tar"}
        dataset = RemoteDataset(
            tar,
            decode={"npy": "npy"},
            transform=take_npy,
            cache=cache,
            storage_options=options,
            **more,
        )
    else:
        pq = f"{root}/parquet"
        parquet = fastload.Parquet(pq) if hasattr(fastload, "Parquet") else pq
        more = {} if hasattr(fastload, "Parquet") else {"shards": "parquet"}
        dataset = RemoteDataset(
            parquet, decode=parquet_row, cache=cache, storage_options=options, **more
        )
    loader = fastload.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=spec["workers"]
    )
    seen, started = 0, time.perf_counter()
    for _ in range(2):
        for batch in loader:
            seen += len(batch)
    print(json.dumps({"seen": seen, "s": time.perf_counter() - started}), flush=True)


# -- parent -----------------------------------------------------------------------------------
def smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        out[name] = int(value.split()[0])
    return out


def tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for kid in (task / "children").read_text().split():
                pids += tree(int(kid))
    except OSError:
        pass
    return pids


def shm_bytes() -> int:
    total = 0
    for folder in Path("/dev/shm").glob("fastload-chunks-*"):
        for path in folder.rglob("*"):
            try:
                if path.is_file():
                    total += path.stat().st_size
            except OSError:
                pass
    return total


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.chunk_memory", "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    peak, shm, both, per = 0, 0, 0, {}
    while proc.poll() is None:
        total = 0
        for pid in tree(proc.pid):
            try:
                s = smaps(pid)
            except OSError:
                continue
            total += s["Pss"]
            old = per.setdefault(pid, {"Pss": 0, "Private_Dirty": 0, "Private_Clean": 0})
            for key in old:
                old[key] = max(old[key], s.get(key, 0))
        now = shm_bytes()
        peak, shm, both = max(peak, total), max(shm, now), max(both, total * 1024 + now)
        time.sleep(0.05)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"child failed: {spec}")
    result = json.loads(out.strip().splitlines()[-1])
    top = sorted(per.items(), key=lambda kv: -kv[1]["Pss"])
    return {
        **result,
        "pss_mib": peak / 1024,
        "shm_mib": shm / 2**20,
        "pss_shm_mib": both / 2**20,  # at one instant; mapped scratch pages counted twice
        "procs": [{k: v / 1024 for k, v in d.items()} | {"pid": pid} for pid, d in top[:6]],
    }


def build(server: Any, root: str, options: dict[str, Any]) -> None:
    fs = filesystem(root, options)
    base = fs._strip_protocol(root)
    bodies = [npy(i) for i in range(N)]
    objects = {f"{base}/objects/{i:06d}.npy": b for i, b in enumerate(bodies)}
    per = N // SHARDS
    for s in range(SHARDS):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(s * per, (s + 1) * per):
                info = tarfile.TarInfo(f"{i:06d}.npy")
                info.size = len(bodies[i])
                tar.addfile(info, io.BytesIO(bodies[i]))
        objects[f"{base}/tar/shard-{s:03d}.tar"] = buf.getvalue()
        table = pa.table(
            {
                "key": list(range(s * per, (s + 1) * per)),
                "npy": pa.array(bodies[s * per : (s + 1) * per], pa.binary()),
            }
        )
        out = io.BytesIO()
        pq.write_table(table, out)
        objects[f"{base}/parquet/part-{s:03d}.parquet"] = out.getvalue()
    keys = list(objects)
    for at in range(0, len(keys), 200):
        fs.pipe({k: objects[k] for k in keys[at : at + 200]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--readers", default="objects,tar,parquet")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    results: dict[str, list[dict[str, Any]]] = {}
    with SeaweedS3Server() as server, tempfile.TemporaryDirectory() as work:
        server.create_bucket(BUCKET)
        root, options = f"s3://{BUCKET}/data", server.storage_options()
        build(server, root, options)
        for repeat in range(args.repeats):
            for reader in args.readers.split(","):
                for workers in map(int, args.workers.split(",")):
                    workdir = f"{work}/{reader}-{workers}-{repeat}"
                    os.makedirs(workdir)
                    spec = dict(
                        reader=reader,
                        workers=workers,
                        root=root,
                        options=options,
                        workdir=workdir,
                    )
                    run = measure(spec)
                    results.setdefault(f"{reader}@{workers}", []).append(run)
                    print(json.dumps({"run": f"{reader}@{workers}", **run}), flush=True)
    print(f"== {args.label} medians of {args.repeats}")
    for name, runs in results.items():
        print(
            f"{name:12s} tree PSS {statistics.median(r['pss_mib'] for r in runs):7.0f} MiB  "
            f"scratch in /dev/shm {statistics.median(r['shm_mib'] for r in runs):6.0f} MiB  "
            f"PSS + scratch {statistics.median(r['pss_shm_mib'] for r in runs):7.0f} MiB  "
            f"{statistics.median(r['s'] for r in runs):5.1f} s"
        )


if __name__ == "__main__":
    main()
