"""Data checks of one stored stage partition (what the Dagster asset checks run), Dagster-free.

Each check reads the committed partition through the store and returns a ``CheckOutcome``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from marl_pipeline.store import ExperienceStore, MicroBatchKey, StoreError
from marl_pipeline.store.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY

FINITE_COLUMNS = {"rollouts": ["logprobs"], "rewards": ["reward", "advantage"]}
"""Float columns that must hold no NaN or inf, per stage."""


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, int | float | str] = field(default_factory=dict)


def check_schema_version(store: ExperienceStore, stage: str, key: MicroBatchKey) -> CheckOutcome:
    """The partition's manifest and every file it names carry the current schema version."""
    manifest = store.manifest(stage, key)
    if manifest is None:
        return CheckOutcome(False, f"{stage} {key} is not committed")
    partition = store.partition_path(stage, key)
    versions = {"manifest": manifest.schema_version}
    for agent, name in manifest.files.items():
        metadata = pq.read_schema(f"{partition}/{name}", filesystem=store.location.arrow).metadata or {}
        versions[agent] = int(metadata.get(SCHEMA_VERSION_KEY, b"0"))
    stale = {where: version for where, version in versions.items() if version != SCHEMA_VERSION}
    description = (f"schema version {SCHEMA_VERSION}" if not stale
                   else f"schema version {stale} where the current one is {SCHEMA_VERSION}")
    return CheckOutcome(not stale, description, {"schema_version": manifest.schema_version})


def check_finite(store: ExperienceStore, stage: str, key: MicroBatchKey) -> CheckOutcome:
    """No NaN or inf in the stage's float columns (logprobs; rewards and advantages)."""
    columns = FINITE_COLUMNS[stage]
    table = store.read(stage, key, columns=columns)
    bad = {}
    for name in columns:
        values = table.column(name)
        if pa.types.is_list(values.type):
            values = pc.list_flatten(values)
        bad[name] = int(pc.sum(pc.invert(pc.is_finite(values))).as_py() or 0) if len(values) else 0
    found = {name: count for name, count in bad.items() if count}
    description = "all finite" if not found else f"NaN or inf values: {found}"
    return CheckOutcome(not found, description, {f"non_finite/{name}": count for name, count in bad.items()})


def check_staleness(store: ExperienceStore, key: MicroBatchKey, bound: int | dict[str, int]) -> CheckOutcome:
    """Every turn's staleness (step - policy_version) is within 0..bound: one bound, or its agent's
    (``ExperimentConfig.staleness_bounds``)."""
    table = store.read("rollouts", key, columns=["policy_version", "agent"])
    loosest = bound if isinstance(bound, int) else max(bound.values())
    if not table.num_rows:
        return CheckOutcome(True, "no turns", {"max_staleness": 0, "bound": loosest})
    staleness = pc.subtract(pa.scalar(key.step, pa.int32()), table.column("policy_version"))
    low, high = pc.min_max(staleness).values()
    bounds = pa.array([bound[agent] if isinstance(bound, dict) else bound
                       for agent in table.column("agent").to_pylist()], pa.int32())
    passed = low.as_py() >= 0 and pc.all(pc.less_equal(staleness, bounds)).as_py()
    description = (f"staleness {low.as_py()}..{high.as_py()} within the bound {bound}" if passed
                   else f"staleness {low.as_py()}..{high.as_py()} outside 0..{bound} (pipeline.staleness, "
                        f"agents.<a>.staleness)")
    return CheckOutcome(passed, description, {"max_staleness": high.as_py(), "min_staleness": low.as_py(),
                                              "bound": loosest})


def check_token_ids(store: ExperienceStore, key: MicroBatchKey) -> CheckOutcome:
    """Prompt and response token ids lie in [0, vocab_size) of the agent's policy (its config.json)."""
    table = store.read("rollouts", key, columns=["prompt_ids", "response_ids", "agent"])
    problems, metadata = [], {}
    for agent in sorted(set(table.column("agent").to_pylist())):
        try:
            vocab = vocab_size(store, key.run, agent)
        except StoreError as error:
            problems.append(str(error))
            continue
        rows = table.filter(pc.equal(table.column("agent"), agent))
        ids = pa.chunked_array([pc.list_flatten(rows.column(c)) for c in ("prompt_ids", "response_ids")])
        if not len(ids):
            continue
        low, high = (v.as_py() for v in pc.min_max(ids).values())
        metadata[f"max_token_id/{agent}"], metadata[f"vocab_size/{agent}"] = high, vocab
        if low < 0 or high >= vocab:
            problems.append(f"{agent}: token ids {low}..{high} outside [0, {vocab})")
    return CheckOutcome(not problems, "; ".join(problems) or "all token ids within the vocabulary", metadata)


def vocab_size(store: ExperienceStore, run: str, agent: str) -> int:
    """The agent's vocabulary size, from its base policy's Hugging Face config."""
    data = store.policy_file(run, agent, 0, "config.json")
    if data is None:
        raise StoreError(f"{agent}: no policy checkpoint at {store.policy_dir(run, agent, 0)} (store {store.uri}) "
                         f"to read the vocabulary size from")
    return int(json.loads(data)["vocab_size"])
