"""Benchmark: the experience store against bare pyarrow.parquet on the same rows, in the same run.

Writes ``--rows`` rollout turns (``--tokens`` prompt + response token ids each, logprobs per response
token) as micro-batch commits of ``--rows-per-commit`` rows and two agents, then reads every micro-batch
back. The bound is bare ``pyarrow.parquet.write_table`` / ``read_table`` of the same tables as the same
files (one per agent per micro-batch, zstd). Bare and store alternate per micro-batch so that machine
noise (other jobs, page cache) hits both alike. Each micro-batch table is generated untimed and dropped
after use, so memory stays at a few micro-batches.

    .venv/bin/python -m bench.pipeline.store --rows 1000000 --rows-per-commit 10000 --tokens 200
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import ROLLOUTS, with_agent

AGENTS = ("solver", "verifier")


def _token_lists(rng: np.random.Generator, rows: int, length: int, dtype, vocab: int = 32000) -> pa.ListArray:
    values = rng.integers(0, vocab, rows * length).astype(dtype) if dtype == np.int32 else \
        (-rng.random(rows * length) * 5).astype(np.float32)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, rows * length + 1, length, dtype=np.int32)), pa.array(values))


def micro_batch_table(rows: int, tokens: int, seed: int) -> pa.Table:
    """``rows`` turns, half per agent (contiguous, as a stage writes them); 3/4 of the tokens are prompt."""
    rng = np.random.default_rng(seed)
    response = tokens // 4
    now = datetime.now(UTC)
    index = np.arange(rows)
    columns = {
        "sample_id": pa.array([f"{seed}-{i // 16}_{i % 2}_{i // 2 % 8}" for i in index]),
        "episode": pa.array(index // 2, pa.int32()), "task_id": pa.array([f"{seed}-{i // 16}" for i in index]),
        "group_id": pa.array([f"{seed}-{i // 16}" for i in index]),
        "trajectory": pa.array(index // 2 % 8, pa.int32()),
        "role": pa.array([AGENTS[i * 2 // rows] for i in index]), "turn": pa.array(index * 2 // rows, pa.int32()),
        "task": pa.array(['{"a": 1, "b": 2}'] * rows), "policy_version": pa.array(np.full(rows, 3, np.int32)),
        "engine": pa.array(["engine-0"] * rows), "adapter": pa.array([None] * rows, pa.string()),
        "prompt_text": pa.array([f"What is {i} + {i}?" for i in index]),
        "response_text": pa.array([str(2 * i) for i in index]),
        "prompt_ids": _token_lists(rng, rows, tokens - response, np.int32),
        "response_ids": _token_lists(rng, rows, response, np.int32),
        "logprobs": _token_lists(rng, rows, response, np.float32),
        "finish_reason": pa.array(["stop"] * rows), "observation": pa.array([None] * rows, pa.string()),
        "rollout_start": pa.array([now] * rows, pa.timestamp("us", "UTC")),
        "rollout_end": pa.array([now] * rows, pa.timestamp("us", "UTC")),
        "engine_seconds": pa.array([None] * rows, pa.float32()),
        "observe_seconds": pa.array([None] * rows, pa.float32()), "group_shortfall": pa.array([0] * rows, pa.int32()),
        "group_dropped": pa.array([0] * rows, pa.int32()), "status": pa.array(["ok"] * rows),
        "error": pa.array([None] * rows, pa.string()), "agent": pa.array([AGENTS[i * 2 // rows] for i in index]),
    }
    return pa.table(columns, schema=with_agent(ROLLOUTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rows-per-commit", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--dir", default=None, help="Scratch directory on the disk to measure (default: a temp dir).")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    store, bare_dir = ExperienceStore(scratch / "store"), scratch / "bare"
    commits = args.rows // args.rows_per_commit
    seconds = {"bare write": 0.0, "store write": 0.0, "bare read": 0.0, "store read": 0.0}
    arrow_bytes = 0
    try:
        for k in range(commits):
            table = micro_batch_table(args.rows_per_commit, args.tokens, seed=k)
            arrow_bytes += table.nbytes
            key = MicroBatchKey("bench", k // 16, k % 16)
            for which in (("bare", "store") if k % 2 == 0 else ("store", "bare")):
                started = time.perf_counter()
                if which == "store":
                    store.commit("rollouts", key, table)
                else:
                    half = table.num_rows // 2
                    for a, agent in enumerate(AGENTS):
                        directory = bare_dir / f"{k}" / f"agent={agent}"
                        directory.mkdir(parents=True)
                        pq.write_table(table.slice(a * half, half).drop_columns(["agent"]),
                                       directory / "part-0.parquet", compression="zstd")
                seconds[f"{which} write"] += time.perf_counter() - started
        for k in range(commits):
            key = MicroBatchKey("bench", k // 16, k % 16)
            for which in (("bare", "store") if k % 2 == 0 else ("store", "bare")):
                started = time.perf_counter()
                if which == "store":
                    rows = store.read("rollouts", key).num_rows
                else:
                    rows = sum(pq.read_table(bare_dir / f"{k}" / f"agent={agent}" / "part-0.parquet").num_rows
                               for agent in AGENTS)
                assert rows == args.rows_per_commit
                seconds[f"{which} read"] += time.perf_counter() - started
        disk = {name: sum(p.stat().st_size for p in (scratch / name).rglob("*") if p.is_file())
                for name in ("store", "bare")}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = commits * args.rows_per_commit
    print(f"{rows} rows x {args.tokens} tokens in {commits} commits of {args.rows_per_commit} rows, 2 agents; "
          f"{arrow_bytes / 1e6:.0f} MB in Arrow; on disk: store {disk['store'] / 1e6:.0f} MB, "
          f"bare {disk['bare'] / 1e6:.0f} MB; {os.cpu_count()} cores")
    print("| | seconds | rows/s | MB/s (Arrow bytes) | store / bare |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, value in seconds.items():
        op = name.split()[1]
        ratio = f"{seconds[f'bare {op}'] / value:.1%}" if name.startswith("store") else ""
        print(f"| {name} | {value:.2f} | {rows / value:,.0f} | {arrow_bytes / 1e6 / value:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
