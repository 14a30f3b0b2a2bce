"""Each step's figures of the run's services, committed with the step as the ``services`` dataset."""

from __future__ import annotations

import pyarrow as pa

from marl_pipeline.services.scheduler import step_figures
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from marl_pipeline.store.schema import SERVICES, with_agent


def commit_step_services(store: ExperienceStore | RecentCommits, run: str, step: int, handles: dict
                         ) -> dict[str, dict]:
    """The schedulers' figures since the previous step, committed under the step (once: a step a resumed launch
    finishes again keeps the figures its first launch committed), by service."""
    if not handles:
        return {}
    key = MicroBatchKey(run, step, 0)
    if store.is_committed("services", key):
        return {row["service"]: row for row in store.read("services", key).to_pylist()}
    figures = step_figures(handles)
    rows = [{**{name: values.get(name) for name in SERVICES.names}, "service": service, "agent": service}
            for service, values in figures.items()]
    store.commit("services", key, pa.Table.from_pylist(rows, schema=with_agent(SERVICES)))
    return {row["service"]: row for row in rows}


def service_summary(store: ExperienceStore, run: str, step: int | None = None) -> list[dict]:
    """Each service's figures over the run's stored steps (or one): counts summed, the worst p99s, the median of the
    steps' p50 latencies, the mean quota use; [] for a run without services."""
    keys = [key for key in store.committed_keys(run, "services") if step is None or key.step == step]
    by_service: dict[str, list[dict]] = {}
    for key in keys:
        for row in store.read("services", key).to_pylist():
            by_service.setdefault(row["service"], []).append(row)
    summary = []
    for service, rows in sorted(by_service.items()):
        present = {name: [row[name] for row in rows if row[name] is not None]
                   for name in ("queue_wait_p99", "latency_p50", "latency_p99", "request_quota_use")}
        medians, uses = sorted(present["latency_p50"]), present["request_quota_use"]
        summary.append({
            "service": service, "steps": len(rows),
            **{name: sum(row[name] for row in rows) for name in ("calls", "throttled", "retries", "failures")},
            "queue_wait_p99": max(present["queue_wait_p99"], default=None),
            "latency_p50": medians[len(medians) // 2] if medians else None,
            "latency_p99": max(present["latency_p99"], default=None),
            "request_quota_use": sum(uses) / len(uses) if uses else None})
    return summary


def describe(figures: dict) -> str:
    """One step's figures of a service, in a line for the run's log."""
    def seconds(name: str) -> str:
        return "-" if figures.get(name) is None else f"{figures[name]:.2f} s"

    use = figures.get("request_quota_use")
    busy = figures.get("backlogged_request_quota_use")
    return (f"{figures['calls']} calls, {figures['throttled']} refused (429), {figures['retries']} retries, "
            f"{figures['failures']} failed; queue wait p50 {seconds('queue_wait_p50')}, p99 "
            f"{seconds('queue_wait_p99')}; call p50 {seconds('latency_p50')}, p99 {seconds('latency_p99')}"
            + (f"; quota used {use:.0%}" if use is not None else "")
            + (f" ({busy:.0%} while calls waited)" if busy is not None else ""))
