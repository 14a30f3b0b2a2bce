"""Experience store on a local directory and on S3 (moto's server): exactly-once commits, pruning, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from marl_pipeline.config import StoreConfig, parse_config
from marl_pipeline.store import ExperienceStore, MicroBatchKey, StoreError
from marl_pipeline.store.schema import REWARDS, SCHEMA_VERSION, with_agent, with_version

ROOT = Path(__file__).resolve().parents[1]


def _rewards(agents: list[str], value: float, per_agent: int = 2) -> pa.Table:
    now = datetime.now(UTC)
    rows = []
    for index, agent in enumerate(agents * per_agent):
        rows.append({"sample_id": f"0-0-{index}_0_0", "episode": index, "task_id": "1+1", "group_id": f"0-0-{index}",
                     "trajectory": 0, "role": agent, "turn": 0, "reward": value, "advantage": 0.0, "reward_start": now,
                     "reward_end": now, "status": "ok", "error": None, "agent": agent})
    return pa.Table.from_pylist(rows)


def _files(store: ExperienceStore, stage: str, key: MicroBatchKey) -> dict[str, str]:
    manifest = store.manifest(stage, key)
    return {agent: f"{store.partition_path(stage, key)}/{name}" for agent, name in manifest.files.items()}


def _everything(store: ExperienceStore) -> list[str]:
    return sorted(store.location.fs.find(store.location.base, withdirs=False))


def test_commit_read_and_replace(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    key = MicroBatchKey("r", 3, 1)
    store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
    table = store.read("rewards", key)
    assert table.num_rows == 4
    assert sorted(set(table.column("agent").to_pylist())) == ["solver", "verifier"]
    first_files = _files(store, "rewards", key)
    store.commit("rewards", key, _rewards(["solver"], 0.5))  # a re-run replaces, never mixes
    table = store.read("rewards", key)
    assert table.num_rows == 2 and set(table.column("reward").to_pylist()) == {0.5}
    assert store.committed_keys("r", "rewards") == [key]
    assert store.runs() == ["r"]
    # The replaced attempt's files are gone: only the manifest and the new file remain.
    remaining = _everything(store)
    assert not set(first_files.values()) & set(remaining)
    assert len(remaining) == 2 and any(p.endswith("/_manifest.json") for p in remaining)


def test_empty_micro_batch_is_a_commit(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    key = MicroBatchKey("r", 0, 0)
    store.commit("rewards", key, with_agent(REWARDS).empty_table())
    assert store.is_committed("rewards", key) and store.read("rewards", key).num_rows == 0


def test_dataset_is_hive_partitioned_and_versioned(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    for step in range(2):
        store.commit("rewards", MicroBatchKey("r", step, 0), _rewards(["solver", "verifier"], float(step)))
    # A plain pyarrow.dataset over the tree (not through the store) sees the hive columns.
    dataset = ds.dataset(store.location.base, filesystem=store.location.arrow, format="parquet", partitioning="hive")
    table = dataset.to_table(filter=(ds.field("stage") == "rewards") & (ds.field("step") == 1))
    assert table.num_rows == 4 and set(table.column("reward").to_pylist()) == {1.0}
    metadata = next(iter(dataset.get_fragments())).physical_schema.metadata
    assert metadata[b"marl_pipeline.schema_version"] == str(SCHEMA_VERSION).encode()
    assert store.read_stage("r", "rewards").num_rows == 8
    assert store.read_stage("r", "rewards", columns=["reward"], filter=ds.field("step") == 1).num_rows == 4
    assert pq.ParquetFile(dataset.files[0], filesystem=store.location.arrow).metadata.row_group(0).column(0) \
        .compression == "ZSTD"


def test_reading_one_agent_of_one_step_opens_only_its_files(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    keys = [MicroBatchKey("r", step, 0) for step in range(2)]
    for key in keys:
        store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
    # Corrupt every other file: a read of `solver` at step 0 must not touch them.
    wanted = _files(store, "rewards", keys[0])["solver"]
    for path in _everything(store):
        if path.endswith(".parquet") and path != wanted:
            store.location.fs.pipe_file(path, b"not parquet")
    table = store.read("rewards", keys[0], agent="solver", columns=["sample_id", "reward"])
    assert table.column_names == ["sample_id", "reward"] and table.num_rows == 2
    assert set(store.read("rewards", keys[0], agent="solver").column("agent").to_pylist()) == {"solver"}
    pruned = store.dataset("r", "rewards").to_table(filter=(ds.field("step") == 0) & (ds.field("agent") == "solver"))
    assert pruned.num_rows == 2
    with pytest.raises(StoreError, match="agent=verifier"):
        store.read("rewards", keys[0])


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_damaged_file_is_named_and_other_partitions_stay_readable(store_config: StoreConfig, damage: str) -> None:
    store = ExperienceStore(store_config)
    keys = [MicroBatchKey("r", 0, mb) for mb in range(2)]
    for key in keys:
        store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
    bad = _files(store, "rewards", keys[1])["verifier"]
    data = store.location.fs.cat_file(bad)
    store.location.fs.pipe_file(bad, b"garbage" * 10 if damage == "corrupted" else data[: len(data) // 2])
    for read in (lambda: store.read("rewards", keys[1]), lambda: store.read_stage("r", "rewards")):
        with pytest.raises(StoreError) as error:
            read()
        assert bad.rsplit("/", 1)[1] in str(error.value)
        assert "partition run=r/stage=rewards/step=0/micro_batch=1/agent=verifier" in str(error.value)
    assert store.read("rewards", keys[0]).num_rows == 4
    assert store.read("rewards", keys[1], agent="solver").num_rows == 2


def test_bad_input_fails_clearly_and_writes_nothing(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    key = MicroBatchKey("r", 0, 0)
    with pytest.raises(StoreError, match="not committed"):
        store.read("rewards", key)
    with pytest.raises(StoreError, match="unknown stage"):
        store.commit("scores", key, _rewards(["solver"], 1.0))
    with pytest.raises(StoreError, match="lacks columns"):
        store.commit("rewards", key, _rewards(["solver"], 1.0).drop_columns(["reward"]))
    with pytest.raises(StoreError, match="invalid agent name 'a/b'"):
        store.commit("rewards", key, _rewards(["a/b"], 1.0))
    good = _rewards(["solver"], 1.0)
    wrong = good.set_column(good.column_names.index("reward"), "reward", pa.array(["x", "y"]))
    with pytest.raises(StoreError, match="column 'reward' has type string"):
        store.commit("rewards", key, wrong)
    store.commit("rewards", key, _rewards(["solver"], 1.0))
    with pytest.raises(StoreError, match="unknown columns"):
        store.read("rewards", key, columns=["rewrd"])
    assert not store.is_committed("rewards", MicroBatchKey("r", 0, 1))
    assert [p for p in _everything(store) if "micro_batch=0" not in p] == []


_KILLED_WRITER = """
import json, os, sys, time
from marl_pipeline.store import commits
from marl_pipeline.config import StoreConfig
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.test_store import _rewards

def stop_before_commit(*args, **kwargs):
    print("about to commit", flush=True)
    time.sleep(600)

# Fault injection: the writer has written every data file and stops at its commit point, where it is killed.
commits.write_manifest = commits.swap_in = stop_before_commit
store = ExperienceStore(StoreConfig(**json.loads(sys.argv[1])))
store.commit("rewards", MicroBatchKey("r", 0, 0), _rewards(["solver", "verifier"], 9.0, per_agent=50))
"""


@pytest.mark.launch
def test_a_writer_killed_before_its_commit_leaves_nothing_visible(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    key = MicroBatchKey("r", 0, 0)
    store.commit("rewards", MicroBatchKey("r", 0, 1), _rewards(["solver"], 1.0))
    for committed_before in (False, True):
        if committed_before:
            store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
        before = _everything(store)
        writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, store_config.model_dump_json()], text=True,
                                  stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert writer.stdout.readline().strip() == "about to commit"
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        leftovers = sorted(set(_everything(store)) - set(before))
        assert len(leftovers) == 2  # both agents' data files of the dead attempt
        assert store.is_committed("rewards", key) == committed_before
        if committed_before:  # the committed version is whole and unchanged
            assert set(store.read("rewards", key).column("reward").to_pylist()) == {1.0}
        assert 9.0 not in store.read_stage("r", "rewards").column("reward").to_pylist()
        assert store.vacuum(older_than=3600) == []  # too young: it could be a writer still at work
        assert store.vacuum(older_than=0, run="other") == []  # another run's leftovers only
        removed = store.vacuum(older_than=0, run="r")
        assert removed and all(any(r in left or left.startswith(r) for r in removed) for left in leftovers)
        assert _everything(store) == before
    assert store.read_stage("r", "rewards").num_rows == 6


@pytest.mark.launch
def test_readers_during_commits_see_one_whole_version(store_config: StoreConfig) -> None:
    store = ExperienceStore(store_config)
    key = MicroBatchKey("r", 0, 0)
    versions = {1.0: _rewards(["solver", "verifier"], 1.0, per_agent=3), 2.0: _rewards(["solver"], 2.0, per_agent=5)}
    store.commit("rewards", key, versions[1.0])
    done, seen, errors = threading.Event(), [], []

    def reader() -> None:
        reader_store = ExperienceStore(store_config)  # its own filesystem handle, as another process would have
        while not done.is_set():
            try:
                table = reader_store.read("rewards", key)
                whole = reader_store.read_stage("r", "rewards")
            except Exception as error:
                errors.append(error)
                return
            for t in (table, whole):
                values = set(t.column("reward").to_pylist())
                assert len(values) == 1 and t.num_rows == versions[values.pop()].num_rows
            seen.append(table.num_rows)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for index in range(31):  # ends on the one-agent version
        store.commit("rewards", key, versions[2.0 if index % 2 == 0 else 1.0])
    done.set()
    for thread in threads:
        thread.join()
    assert errors == [] and seen
    assert len(_everything(store)) == 2  # the manifest and one file: no replaced attempt left behind


def test_older_schema_versions_are_read_or_refused_clearly(tmp_path: Path) -> None:
    # A version-1 partition as the first store wrote it: no manifest, part-0.parquet, no reward timestamps.
    store = ExperienceStore(tmp_path)
    v1 = pa.schema([field for field in REWARDS
                    if field.name not in ("reward_start", "reward_end", "model_score", "group_id")])
    table = _rewards(["solver"], 1.0).select(v1.names).cast(v1)
    directory = tmp_path / "run=r" / "stage=rewards" / "step=0" / "micro_batch=0" / "agent=solver"
    directory.mkdir(parents=True)
    pq.write_table(table.replace_schema_metadata({b"marl_pipeline.schema_version": b"1"}), directory / "part-0.parquet")
    read = store.read("rewards", MicroBatchKey("r", 0, 0))
    assert read.num_rows == 2 and read.column("reward_start").null_count == 2
    assert read.column("model_score").null_count == 2  # added in version 4
    assert read.column("group_id").to_pylist() == ["0-0-0", "0-0-1"]  # added in version 5, derived from sample_id
    assert store.committed_keys("r", "rewards") == [MicroBatchKey("r", 0, 0)]
    # A version this code does not know is refused, naming the partition and the versions it reads.
    key = MicroBatchKey("r", 1, 0)
    path = Path(store.commit("rewards", key, _rewards(["solver"], 1.0)))
    record = json.loads((path / "_manifest.json").read_text())
    (path / "_manifest.json").write_text(json.dumps({**record, "schema_version": 99}))
    with pytest.raises(StoreError, match=r"rewards r/step=1/micro_batch=0 .* schema version 99; this marl_pipeline"):
        store.read("rewards", key)
    assert with_version(REWARDS).metadata[b"marl_pipeline.schema_version"] == str(SCHEMA_VERSION).encode()


def as_version_4(store: ExperienceStore, stage: str, key: MicroBatchKey) -> None:
    """Rewrite a committed local partition as schema version 4 wrote it: no group_id column, version 4 in every
    file's metadata and in the manifest."""
    partition = Path(store.partition_path(stage, key))
    for name in store.manifest(stage, key).files.values():
        table = pq.ParquetFile(partition / name).read().drop_columns(["group_id"])
        pq.write_table(table.replace_schema_metadata({b"marl_pipeline.schema_version": b"4"}), partition / name)
    record = json.loads((partition / "_manifest.json").read_text())
    (partition / "_manifest.json").write_text(json.dumps({**record, "schema_version": 4}))


def test_version_4_rows_get_their_group_from_the_sample_id(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    old, new = MicroBatchKey("r", 0, 0), MicroBatchKey("r", 1, 0)
    store.commit("rewards", old, _rewards(["solver", "verifier"], 1.0))
    as_version_4(store, "rewards", old)
    assert "group_id" not in pq.read_schema(next(iter(_files(store, "rewards", old).values()))).names
    # A current partition whose groups are not what its sample_ids say: stored values are never overwritten.
    current = _rewards(["solver"], 2.0)
    store.commit("rewards", new, current.set_column(current.column_names.index("group_id"), "group_id",
                                                    pa.array(["g", "g"])))
    derived = {f"0-0-{index}_0_0": f"0-0-{index}" for index in range(4)}
    table = store.read("rewards", old)
    assert dict(zip(table.column("sample_id").to_pylist(), table.column("group_id").to_pylist())) == derived
    # Asked for alone, the group still comes derived (its source column is read, then left out).
    assert store.read("rewards", old, columns=["group_id"]).column_names == ["group_id"]
    assert sorted(store.read("rewards", old, columns=["group_id"]).column("group_id").to_pylist()) == sorted(
        derived.values())
    whole = store.read_stage("r", "rewards", columns=["step", "group_id"])
    assert sorted(whole.filter(pc.field("step") == 0).column("group_id").to_pylist()) == sorted(derived.values())
    assert whole.filter(pc.field("step") == 1).column("group_id").to_pylist() == ["g", "g"]
    # A bare pyarrow read of the tree sees the files as stored: the old ones have no group.
    raw = store.dataset("r", "rewards").to_table(filter=ds.field("step") == 0)
    assert raw.column("group_id").null_count == 4
    # A null group is how a reader tells an older row, so a commit refuses one.
    with pytest.raises(StoreError, match="'group_id' column has 2 null values"):
        store.commit("rewards", new, current.set_column(current.column_names.index("group_id"), "group_id",
                                                        pa.nulls(2, pa.string())))


def test_s3_settings_from_the_standard_aws_variables(s3_endpoint: str, monkeypatch, tmp_path: Path) -> None:
    for name, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    store = ExperienceStore(f"s3://marl/env-{tmp_path.name}")
    store.commit("rewards", MicroBatchKey("r", 0, 0), _rewards(["solver"], 1.0))
    assert store.read_stage("r", "rewards").num_rows == 2
    assert store.root == (Path(".marl") / "cache" / f"marl/env-{tmp_path.name}").absolute()


def test_store_config_accepts_a_string_or_a_mapping(demo_config_data: dict) -> None:
    assert parse_config({**demo_config_data, "store": "some/dir"}).store.uri == "some/dir"
    config = parse_config({**demo_config_data, "store": {"uri": "s3://b/p", "endpoint_url": "http://h:9000"}})
    assert config.store.endpoint_url == "http://h:9000" and "secret" not in repr(config.store)
    with pytest.raises(ValueError, match="scheme 'gs' is not supported"):
        parse_config({**demo_config_data, "store": "gs://b/p"})
    with pytest.raises(ValueError, match=r"store\.compresion: unknown field"):
        parse_config({**demo_config_data, "store": {"uri": "x", "compresion": "zstd"}})
