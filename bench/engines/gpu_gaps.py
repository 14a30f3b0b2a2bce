"""Where a GPU step leaves the GPU idle: reads the chrome traces ``bench/engines/gpu_trainer.py --trace`` writes (one
step, CPU operators with Python stacks and GPU kernels) and reports the step's span, the GPU's busy time (kernels,
copies and fills, overlaps merged), its idle gaps, and the idle time by what the CPU was doing meanwhile: the innermost
frame of this project's code (or of the bench's bare loop) running at the gap's middle, and the CUDA runtime call under
it, if any (a ``cudaStreamSynchronize`` or a pageable ``cudaMemcpyAsync`` is the host waiting for the GPU).

    python3 -m bench.engines.gpu_gaps TRACE.json.gz [TRACE.json.gz ...] [--min-gap-us 20]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
from collections import Counter
from pathlib import Path

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
OURS = ("marl_pipeline/", "gpu_trainer.py", "test_trainer_cuda.py")


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _innermost(frames: list[tuple[float, float, str]], starts: list[float], at: float, keep) -> str | None:
    """The shortest frame containing ``at`` among those ``keep`` accepts."""
    best = None
    for start, end, name in frames[: bisect.bisect_right(starts, at)]:
        if start <= at <= end and keep(name) and (best is None or end - start < best[1] - best[0]):
            best = (start, end, name)
    return best[2] if best else None


def analyse(path: Path, min_gap_us: float) -> dict:
    events = _events(path)
    gpu = _busy([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU])
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "cuda_driver")]
    begin = min(e["ts"] for e in cpu)
    end = max(b for _, b in gpu)
    busy = sum(b - a for a, b in gpu)
    frames = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "python_function")
    runtime = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    frame_starts, runtime_starts = [f[0] for f in frames], [r[0] for r in runtime]
    gaps = [(begin, gpu[0][0])] + [(a[1], b[0]) for a, b in itertools.pairwise(gpu)]
    by_cause: Counter = Counter()
    counts: Counter = Counter()
    for start, stop in gaps:
        if stop - start < min_gap_us:
            continue
        middle = (start + stop) / 2
        ours = _innermost(frames, frame_starts, middle, lambda name: any(k in name for k in OURS)) or "-"
        call = _innermost(runtime, runtime_starts, middle, lambda name: True) or ""
        key = f"{ours} | {call}" if call else ours
        by_cause[key] += stop - start
        counts[key] += 1
    return {"trace": path.name, "span_ms": (end - begin) / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_idle_ms": (end - begin - busy) / 1e3, "idle_gaps_ms": sum(by_cause.values()) / 1e3,
            "idle_by_cause": [{"ms": round(ms / 1e3, 3), "gaps": counts[key], "where": key}
                              for key, ms in by_cause.most_common(15)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    args = parser.parse_args()
    for path in args.traces:
        print(json.dumps(analyse(path, args.min_gap_us), indent=1))


if __name__ == "__main__":
    main()
