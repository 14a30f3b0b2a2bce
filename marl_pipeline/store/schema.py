"""Arrow schemas of the experience store: one row per turn, column groups after FlexMARL.

meta    who and when: sample_id, episode, agent, role, turn, policy_version, timestamps
data    what: token ids, per-token logprobs, texts, outcomes, rewards, advantages
status  per-stage state and error message

``run``, ``step``, ``micro_batch`` and ``agent`` are hive partition columns: they live in the
directory names, not in the files, and come back as columns when a dataset is read.
A change to any schema here bumps ``SCHEMA_VERSION`` (stored in every file's metadata and in each
partition's commit manifest) and records what changed in ``SCHEMA_CHANGES``. A version listed in
``READABLE_SCHEMA_VERSIONS`` is read under the current schema (columns it lacks come back null, or
derived from the columns it has: ``DERIVED_COLUMNS``); any other version is refused with a message naming
the file (docs/store.md).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 13
SCHEMA_CHANGES = {
    1: "first version",
    2: "environment_start/environment_end and reward_start/reward_end: timestamps of every stage",
    3: "stage_enqueued/stage_started/stage_ended on every stage: the orchestrator's timing of the micro-batch",
    4: "rollouts.observation: the environment's reply to a turn (observe); rewards.model_score: the reward model's",
    5: "group_id on every turn: the GRPO group, stored instead of parsed out of sample_id (derived so for older files)",
    6: "rollouts.adapter: the named adapter of version 0 that served the turn (agents.<a>.turn_adapters); null: none",
    7: "policy_updates.compute_seconds, rollouts.engine_seconds: the actors' own time on the micro-batch (null: older)",
    8: "health.trainer_tokens_per_s, health.mfu: the trainer's throughput and MFU at the step's update (null: older)",
    9: "rollouts.group_shortfall, rollouts.group_dropped and health.short_groups, health.shortfall, "
       "health.dropped_episodes: groups short of n finished episodes, and episodes over-sampling dropped "
       "(null: older); the services dataset (one row per external service and step)",
    10: "health.reward_mean: the agent's mean reward in the step, for the windowed collapse rule (null: older)",
    11: "rollouts.observe_seconds: how long the environment's reply to the turn took (null: no observe, or older)",
    12: "health.top_answer_reward, health.reward_max: the most frequent response's base rate and the best reward, "
        "to tell collapse from convergence; health.staleness_max, health.stale_share: how far the agent's turns "
        "lagged the step (null: older)",
    13: "health.step_finished: when the launch finished the step (its StepFinished), the step time as the launch "
        "reported it (null: recomputed from the store, or older)",
}
# Versions whose files this code reads: each change so far only added columns, null or derived in older files.
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
SCHEMA_VERSION_KEY = b"marl_pipeline.schema_version"

PARTITION_SCHEMA = pa.schema(
    [("run", pa.string()), ("stage", pa.string()), ("step", pa.int32()), ("micro_batch", pa.int32()),
     ("agent", pa.string())]
)

_TURN_KEYS = [
    pa.field("sample_id", pa.string()),  # {input_id}_{turn}_{trajectory}
    pa.field("episode", pa.int32()),  # index of the episode within its micro-batch
    # The task's own id. Not the group: two prompts of a micro-batch may draw the same task.
    pa.field("task_id", pa.string()),
    # The GRPO group: the n episodes sampled from one task prompt, whose rewards an advantage is relative to.
    # The rollout stage writes the prompt's input_id ({step}-{micro_batch}-{prompt_index}).
    pa.field("group_id", pa.string()),
    pa.field("trajectory", pa.int32()),  # which of the group's n samples
    pa.field("role", pa.string()),
    pa.field("turn", pa.int32()),
]

ROLLOUTS = pa.schema(
    _TURN_KEYS
    + [
        pa.field("task", pa.string()),  # the task as JSON, so later stages need nothing else
        pa.field("policy_version", pa.int32()),
        pa.field("engine", pa.string()),
        pa.field("adapter", pa.string()),  # the named adapter that served the turn (policy/lora.py); null: none
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("logprobs", pa.list_(pa.float32())),  # rollout engine's logprob of each response token
        pa.field("finish_reason", pa.string()),
        pa.field("observation", pa.string()),  # the environment's reply to this turn (observe); null: none
        pa.field("rollout_start", pa.timestamp("us", tz="UTC")),
        pa.field("rollout_end", pa.timestamp("us", tz="UTC")),
        pa.field("engine_seconds", pa.float32()),  # its share of the engine steps that computed it; null: not measured
        pa.field("observe_seconds", pa.float32()),  # the environment's reply to it (observe); null: none
        # The turn's group, the same on each of its rows: n (samples_per_prompt) minus its episodes that finished
        # (0: a full group), and its episodes over-sampling dropped (pipeline.rollout.oversample); null: older
        pa.field("group_shortfall", pa.int32()),
        pa.field("group_dropped", pa.int32()),
        pa.field("status", pa.string()),  # ok, observe_failed, timeout, prompt_too_long, dropped (why in error)
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
        pa.field("dropped_rows", pa.int32()),  # rows of zero-advantage groups left out (dynamic sampling); null: older
        pa.field("compute_seconds", pa.float32()),  # the trainer actor's own time on the micro-batch; null: older
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
# policy-update rows made before the mismatch statistics (or dynamic sampling) existed have none, nor rollouts
# made by hand the group figures of over-sampling, nor a health table recomputed from the store the step's end.
OPTIONAL_COLUMNS = frozenset([field.name for field in STAGE_TIMING]
                             + ["observation", "model_score", "mismatch_abs_logprob", "mismatch_ratio_std",
                                "dropped_rows", "adapter", "grad_norm", "compute_seconds", "engine_seconds",
                                "observe_seconds", "step_finished",
                                "trainer_tokens_per_s", "mfu", "group_shortfall", "group_dropped"])
# Columns a commit refuses null values in: a reader takes a null group_id for a row written before it existed.
NON_NULL_COLUMNS = frozenset(["group_id"])

STAGE_SCHEMAS = {
    "rollouts": pa.schema(list(ROLLOUTS) + STAGE_TIMING),
    "environment_results": pa.schema(list(ENVIRONMENT_RESULTS) + STAGE_TIMING),
    "rewards": pa.schema(list(REWARDS) + STAGE_TIMING),
    "policy_updates": pa.schema(list(POLICY_UPDATES) + STAGE_TIMING),
}
STAGES = tuple(STAGE_SCHEMAS)


def with_time(table: pa.Table, field: pa.Field, seconds: float) -> pa.Table:
    """``table`` with the timestamp column ``field`` set to ``seconds`` (since the epoch) on every row, replaced
    where the table has it, else appended."""
    column = pa.array([int(seconds * 1e6)] * table.num_rows, pa.int64()).cast(field.type)
    if field.name in table.column_names:
        return table.set_column(table.column_names.index(field.name), field.name, column)
    return table.append_column(field, column)


def with_stage_timing(table: pa.Table, enqueued: float, started: float, ended: float) -> pa.Table:
    """``table`` with the micro-batch's stage timing columns (epoch seconds in) set on every row."""
    for field, seconds in zip(STAGE_TIMING, (enqueued, started, ended)):
        table = with_time(table, field, seconds)
    return table


def with_agent(schema: pa.Schema) -> pa.Schema:
    """A stage schema plus the ``agent`` column: what a stage function returns and the store splits on."""
    return schema.append(pa.field("agent", pa.string()))


def with_version(schema: pa.Schema) -> pa.Schema:
    """The schema with the schema version in its metadata, as written to every file."""
    return schema.with_metadata({SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()})


def group_ids_from_sample_ids(sample_ids: pa.ChunkedArray) -> pa.ChunkedArray:
    """The GRPO group of turns written before schema 5: input_id, the sample_id before its first ``_``
    (``{input_id}_{turn}_{trajectory}``), exactly what the reward stage grouped on before the column existed."""
    return pc.list_element(pc.split_pattern(sample_ids, "_", max_splits=1), 0)


# Columns an older readable version lacks that the store derives on read from a column it has, rather than
# returning them null: column -> (source column, derivation). A commit never stores them null (NON_NULL_COLUMNS),
# so a null is always an older row's.
DERIVED_COLUMNS: dict[str, tuple[str, Callable[[pa.ChunkedArray], pa.ChunkedArray]]] = {
    "group_id": ("sample_id", group_ids_from_sample_ids),
}


def columns_to_read(columns: list[str] | None) -> list[str] | None:
    """A read's projection plus the source columns its derived columns need (``upgraded`` drops them again)."""
    if columns is None:
        return None
    sources = [DERIVED_COLUMNS[name][0] for name in columns if name in DERIVED_COLUMNS]
    return columns + [source for source in dict.fromkeys(sources) if source not in columns]


def upgraded(table: pa.Table, columns: list[str] | None = None) -> pa.Table:
    """A table read under the current schema, its derived columns filled in where older rows left them null,
    projected to ``columns`` (a read's projection; None: every column). The one place older rows are upgraded."""
    for name, (source, derive) in DERIVED_COLUMNS.items():
        if name in table.column_names and table.column(name).null_count:
            values = pc.coalesce(table.column(name), derive(table.column(source)))
            table = table.set_column(table.column_names.index(name), name, values)
    return table if columns is None else table.select(columns)


# One row per held-out case per agent: an agent's greedy answer to one of its evaluation cases (the plugin's
# ``evaluation_cases``), stored under step=<v> for policy version v; not a pipeline stage, but stored, read and
# committed like one, so an evaluation is as queryable and replaceable as any partition.
EVALUATIONS = pa.schema(
    [
        pa.field("policy_version", pa.int32()),
        pa.field("case", pa.int32()),  # index of the case in the agent's held-out set
        pa.field("task_id", pa.string()),
        pa.field("task", pa.string()),  # JSON
        # JSON list of {role, text, observation}: the turns before the agent's; agent "team" (stages/team.py): a list
        # of such lists, the case's sampled episodes
        pa.field("transcript", pa.string()),
        pa.field("label", pa.string()),
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("answer", pa.string()),  # the plugin's normalised answer (answer_of)
        pa.field("metrics", pa.string()),  # JSON: the agent's metrics at this version (the same on each of its rows)
        pa.field("status", pa.string()),
        pa.field("error", pa.string()),
    ]
)

# One row per agent per step: its training-health signals, computed from the step's stored partitions when every
# agent has stepped past it (stages/health.py), stored under step=<s>/micro_batch=0.
HEALTH = pa.schema(
    [
        pa.field("policy_version", pa.int32()),  # the version the step's update made
        pa.field("groups", pa.int32()),  # GRPO groups (an episode group's rows of this agent)
        pa.field("zero_variance_groups", pa.float32()),  # share of groups whose rewards are all equal: no signal
        pa.field("distinct_responses", pa.float32()),  # mean share of distinct responses to one prompt
        pa.field("top_response_share", pa.float32()),  # mean share of a prompt's most frequent response
        pa.field("top_answer_share", pa.float32()),  # the step's most frequent response's share, over all prompts,
        # in the agent's turn where it is highest
        pa.field("token_entropy", pa.float32()),  # mean -log p of the sampled tokens (the entropy's estimate)
        pa.field("response_length", pa.float32()),  # mean response tokens
        pa.field("truncated_share", pa.float32()),  # share of responses cut at the token limit
        pa.field("loss_per_token", pa.float32()),
        pa.field("clip_fraction", pa.float32()),  # token-weighted over the step's micro-batches
        pa.field("mismatch_abs_logprob", pa.float32()),  # token-weighted |trainer - engine| log-probability
        pa.field("grad_norm", pa.float32()),  # null: stepped by an earlier launch of the run
        # The trainer's step: real tokens computed a second, and MFU as a fraction (training/flops.py); null as above
        pa.field("trainer_tokens_per_s", pa.float32()),
        pa.field("mfu", pa.float32()),
        # Groups short of n finished episodes, the episodes they lack, and episodes over-sampling dropped; null: older
        pa.field("short_groups", pa.int32()),
        pa.field("shortfall", pa.int32()),
        pa.field("dropped_episodes", pa.int32()),
        pa.field("reward_mean", pa.float32()),  # the agent's mean reward over its scored turns; null: older
        # The mean reward of the turns giving the agent's most frequent response (in top_answer_share's turn): that
        # answer's base rate; and the best reward any of its turns earned. Null: older
        pa.field("top_answer_reward", pa.float32()),
        pa.field("reward_max", pa.float32()),
        # How far the agent's turns lagged the step: the largest lag (step - policy_version) and the share sampled at
        # an older version (each agent has its own bound, agents.<a>.staleness). Null: older
        pa.field("staleness_max", pa.int32()),
        pa.field("stale_share", pa.float32()),
        # When the launch finished the step: after the last agent's update was served and published, where
        # StepFinished.seconds ends (null: recomputed from the store, as the health asset does, or older)
        pa.field("step_finished", pa.timestamp("us", tz="UTC")),
    ]
)

# One row per external service per step (services.<name>): what its scheduler saw between the previous step's end
# and this one's (marl_pipeline/services), stored under step=<s>/micro_batch=0 with the service's name as ``agent``.
SERVICES = pa.schema(
    [
        pa.field("service", pa.string()),
        pa.field("seconds", pa.float32()),  # the window the figures cover
        pa.field("calls", pa.int32()),  # tries answered or failed, retries included
        pa.field("granted", pa.int32()),  # tries the scheduler let through
        pa.field("tokens", pa.int64()),  # the answers' usage.total_tokens (the estimate where an answer has none)
        pa.field("throttled", pa.int32()),  # answered 429
        pa.field("retries", pa.int32()),
        pa.field("failures", pa.int32()),  # calls given up: refused, or failed on every try
        pa.field("queue_wait_p50", pa.float32()),  # seconds a call waited for its grant
        pa.field("queue_wait_p99", pa.float32()),
        pa.field("latency_p50", pa.float32()),  # seconds a try took at the service
        pa.field("latency_p99", pa.float32()),
        pa.field("request_quota_use", pa.float32()),  # grants / (requests_per_second x seconds); null: no such quota
        pa.field("token_quota_use", pa.float32()),  # tokens / tokens_per_minute over the window; null: no such quota
        pa.field("backlogged_share", pa.float32()),  # of the window, the time some call waited for the quota
        pa.field("backlogged_request_quota_use", pa.float32()),  # request_quota_use while calls waited
    ]
)

DATASET_SCHEMAS = {**STAGE_SCHEMAS, "evaluations": EVALUATIONS, "health": HEALTH, "services": SERVICES}
"""Every dataset the store holds: the four stages, the held-out evaluations, the health signals, the services."""
