"""Arrow schemas of the experience store: one row per turn, column groups after FlexMARL.

meta    who and when: sample_id, episode, agent, role, turn, policy_version, timestamps
data    what: token ids, per-token logprobs, texts, outcomes, rewards, advantages
status  per-stage state and error message

``run``, ``step``, ``micro_batch`` and ``agent`` are hive partition columns: they live in the
directory names, not in the files, and come back as columns when a dataset is read.
A change to any schema here bumps ``SCHEMA_VERSION`` (stored in every file's metadata and in each
partition's commit manifest) and records what changed in ``SCHEMA_CHANGES``. A version listed in
``READABLE_SCHEMA_VERSIONS`` is read under the current schema (columns it lacks come back null);
any other version is refused with a message naming the file (docs/store.md).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 4
SCHEMA_CHANGES = {
    1: "first version",
    2: "environment_start/environment_end and reward_start/reward_end: timestamps of every stage",
    3: "stage_enqueued/stage_started/stage_ended on every stage: the orchestrator's timing of the micro-batch",
    4: "rollouts.observation: the environment's reply to a turn (observe); rewards.model_score: the reward model's",
}
# Versions whose files this code reads: each change so far only added nullable columns.
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
SCHEMA_VERSION_KEY = b"marl_pipeline.schema_version"

PARTITION_SCHEMA = pa.schema(
    [("run", pa.string()), ("stage", pa.string()), ("step", pa.int32()), ("micro_batch", pa.int32()),
     ("agent", pa.string())]
)

_TURN_KEYS = [
    pa.field("sample_id", pa.string()),  # {input_id}_{turn}_{trajectory}
    pa.field("episode", pa.int32()),  # index of the episode within its micro-batch
    pa.field("task_id", pa.string()),  # input_id: the task prompt's id
    pa.field("trajectory", pa.int32()),  # which of the n samples of the task
    pa.field("role", pa.string()),
    pa.field("turn", pa.int32()),
]

ROLLOUTS = pa.schema(
    _TURN_KEYS
    + [
        pa.field("task", pa.string()),  # the task as JSON, so later stages need nothing else
        pa.field("policy_version", pa.int32()),
        pa.field("engine", pa.string()),
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("logprobs", pa.list_(pa.float32())),  # rollout engine's logprob of each response token
        pa.field("finish_reason", pa.string()),
        pa.field("observation", pa.string()),  # the environment's reply to this turn (observe); null: none
        pa.field("rollout_start", pa.timestamp("us", tz="UTC")),
        pa.field("rollout_end", pa.timestamp("us", tz="UTC")),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)

ENVIRONMENT_RESULTS = pa.schema(
    _TURN_KEYS
    + [
        pa.field("outcome", pa.string()),
        pa.field("success", pa.bool_()),
        pa.field("observation", pa.string()),
        pa.field("info", pa.string()),  # JSON
        pa.field("environment_start", pa.timestamp("us", tz="UTC")),  # the episode's execution
        pa.field("environment_end", pa.timestamp("us", tz="UTC")),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)

REWARDS = pa.schema(
    _TURN_KEYS
    + [
        pa.field("reward", pa.float32()),
        pa.field("advantage", pa.float32()),  # group-relative, per agent
        pa.field("model_score", pa.float32()),  # the reward model's score of the turn, in [0, 1]; null: not scored
        pa.field("reward_start", pa.timestamp("us", tz="UTC")),  # the episode's scoring
        pa.field("reward_end", pa.timestamp("us", tz="UTC")),
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)

# One row per agent per micro-batch: the trainer's gradient accumulation of that micro-batch.
POLICY_UPDATES = pa.schema(
    [
        pa.field("policy_version", pa.int32()),  # the version the gradient was taken at
        pa.field("rows", pa.int32()),
        pa.field("tokens", pa.int64()),
        pa.field("loss_sum", pa.float64()),  # summed loss; divide by the step's tokens (or sequences)
        pa.field("clip_fraction", pa.float32()),
        pa.field("mean_ratio", pa.float32()),  # mean of exp(trainer logprob - engine logprob) over response tokens
        pa.field("mismatch_abs_logprob", pa.float32()),  # mean |trainer logprob - engine logprob|; null: older
        pa.field("mismatch_ratio_std", pa.float32()),  # std of exp(trainer logprob - engine logprob); null: older
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)

# The same on every row of a micro-batch's partition: when it became ready for the stage (inputs
# committed, or the staleness gate opened), when the stage started it and when the stage's work ended
# (before the commit's write). Every pipeline figure of a run can be recomputed from these.
STAGE_TIMING = [pa.field(name, pa.timestamp("us", tz="UTC"))
                for name in ("stage_enqueued", "stage_started", "stage_ended")]

# Columns a stage's producer may leave out of a table it commits (they are stored null): the orchestrator
# adds the stage timing, and plugins without ``observe`` or runs without a reward model have nothing to put;
# policy-update rows made before the mismatch statistics existed have none.
OPTIONAL_COLUMNS = frozenset([field.name for field in STAGE_TIMING]
                             + ["observation", "model_score", "mismatch_abs_logprob", "mismatch_ratio_std"])

STAGE_SCHEMAS = {
    "rollouts": pa.schema(list(ROLLOUTS) + STAGE_TIMING),
    "environment_results": pa.schema(list(ENVIRONMENT_RESULTS) + STAGE_TIMING),
    "rewards": pa.schema(list(REWARDS) + STAGE_TIMING),
    "policy_updates": pa.schema(list(POLICY_UPDATES) + STAGE_TIMING),
}
STAGES = tuple(STAGE_SCHEMAS)


def with_stage_timing(table: pa.Table, enqueued: float, started: float, ended: float) -> pa.Table:
    """``table`` with the micro-batch's stage timing columns (epoch seconds in) set on every row."""
    for field, seconds in zip(STAGE_TIMING, (enqueued, started, ended)):
        column = pa.array([int(seconds * 1e6)] * table.num_rows, pa.int64()).cast(field.type)
        if field.name in table.column_names:
            table = table.set_column(table.column_names.index(field.name), field.name, column)
        else:
            table = table.append_column(field, column)
    return table


def with_agent(schema: pa.Schema) -> pa.Schema:
    """A stage schema plus the ``agent`` column: what a stage function returns and the store splits on."""
    return schema.append(pa.field("agent", pa.string()))


def with_version(schema: pa.Schema) -> pa.Schema:
    """The schema with the schema version in its metadata, as written to every file."""
    return schema.with_metadata({SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()})
