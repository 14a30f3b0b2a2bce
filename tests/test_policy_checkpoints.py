"""Policy checkpoints and launch records of a store: in the bucket for S3 (any node reads them), the local cache
only a copy; the same API on a local store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from marl_pipeline.config import RetentionConfig, StoreConfig
from marl_pipeline.store import ExperienceStore, StoreError


def _save(store: ExperienceStore, run: str, agent: str, version: int, weights: bytes) -> Path:
    staging = store.staging_policy_dir(run, agent, version)
    (staging / "config.json").write_text(json.dumps({"vocab_size": 7, "version": version}))
    (staging / "model.safetensors").write_bytes(weights)
    (staging / "tokenizer").mkdir()
    (staging / "tokenizer" / "vocab.txt").write_text("a b c")
    return staging


def _other_node(config: StoreConfig, tmp_path: Path, name: str) -> ExperienceStore:
    """The same store opened as another Ray node would: its own, empty policy cache."""
    if config.uri.startswith("s3://"):
        return ExperienceStore(config.model_copy(update={"policy_cache": str(tmp_path / name)}))
    return ExperienceStore(config)


def test_a_committed_version_is_read_back_whole_from_another_node(store_config: StoreConfig, tmp_path: Path) -> None:
    writer = ExperienceStore(store_config)
    weights = bytes(range(256)) * 64
    writer.commit_policy(_save(writer, "r", "solver", 0, weights), "r", "solver", 0)
    # A trainer's path: upload on its node, publish (with the driver's timing) from the driver.
    upload = writer.upload_policy(_save(writer, "r", "solver", 1, weights[::-1]), "r", "solver", 1)
    reader = _other_node(store_config, tmp_path, "node-b")
    assert reader.policy_versions("r", "solver") == [0]  # uploaded, not yet published: invisible
    writer.publish_policy(upload, {"timing.json": b'{"step": 0}'})
    assert reader.policy_versions("r", "solver") == [0, 1]
    directory = reader.require_policy("r", "solver", 1)
    assert (directory / "model.safetensors").read_bytes() == weights[::-1]
    assert (directory / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert json.loads((directory / "timing.json").read_text()) == {"step": 0}
    assert reader.policy_file("r", "solver", 0, "config.json") == b'{"vocab_size": 7, "version": 0}'
    assert reader.policy_file("r", "solver", 0, "absent.json") is None
    with pytest.raises(StoreError, match=r"policy version 2 of agent 'solver' in run 'r' is not stored.*\[0, 1\]"):
        reader.require_policy("r", "solver", 2)

    reader.write_record("r", "launch.json", {"last_step": 4, "finished": False})
    assert writer.read_record("r", "launch.json") == {"last_step": 4, "finished": False}
    assert writer.read_record("other", "launch.json") is None


def test_on_s3_the_cache_is_a_copy_never_the_only_one(s3_endpoint: str, tmp_path: Path) -> None:
    config = StoreConfig(uri=f"s3://marl/{tmp_path.name}", endpoint_url=s3_endpoint, region="us-east-1",
                         access_key_id="testing", secret_access_key="testing", policy_cache=str(tmp_path / "a"))
    store = ExperienceStore(config)
    store.commit_policy(_save(store, "r", "solver", 0, b"first"), "r", "solver", 0)
    assert not store.policy_dir("r", "solver", 0).exists()  # the committed copy is in the bucket, nowhere else
    assert store.location.fs.exists(f"{store.location.base}/run=r/policies/agent=solver/version=0/_manifest.json")
    assert (store.require_policy("r", "solver", 0) / "model.safetensors").read_bytes() == b"first"
    shutil.rmtree(tmp_path / "a")  # a node lost its disk: fetched again
    assert (store.require_policy("r", "solver", 0) / "model.safetensors").read_bytes() == b"first"

    # A stale copy (a cache left from another attempt of the version) is replaced by the committed one.
    cached = store.require_policy("r", "solver", 0)
    (cached / "model.safetensors").write_bytes(b"stale")
    manifest = json.loads((cached / "_manifest.json").read_text())
    (cached / "_manifest.json").write_text(json.dumps({**manifest, "attempt": "0000000000000000-deadbeef"}))
    assert (store.require_policy("r", "solver", 0) / "model.safetensors").read_bytes() == b"first"

    # An upload whose writer died before the publish is garbage, collected once old enough; committed files stay.
    store.upload_policy(_save(store, "r", "solver", 1, b"orphan"), "r", "solver", 1)
    assert store.policy_versions("r", "solver") == [0]
    assert store.vacuum(older_than=3600) == []
    collected = store.vacuum(older_than=0)
    assert len(collected) == 1 and "version=1/" in collected[0]
    assert store.location.fs.find(f"{store.location.base}/run=r/policies/agent=solver/version=1") == []
    assert (store.require_policy("r", "solver", 0) / "model.safetensors").read_bytes() == b"first"


def test_pruning_removes_a_version_from_the_bucket_and_the_cache(store_config: StoreConfig, tmp_path: Path) -> None:
    store = ExperienceStore(store_config)
    for version in range(4):
        store.commit_policy(_save(store, "r", "solver", version, b"w%d" % version), "r", "solver", version)
        store.require_policy("r", "solver", version)
    pruned = store.prune_policies("r", "solver", RetentionConfig(keep_last=1, keep_every=2))
    assert pruned == [1]
    assert store.policy_versions("r", "solver") == [0, 2, 3]
    assert not store.policy_dir("r", "solver", 1).exists()
    assert _other_node(store_config, tmp_path, "node-c").policy_versions("r", "solver") == [0, 2, 3]
    if not store.location.local:
        assert store.location.fs.find(f"{store.location.base}/run=r/policies/agent=solver/version=1") == []


@pytest.mark.launch
def test_the_runs_built_in_models_are_committed_like_policies(store_config: StoreConfig, demo_config_data: dict,
                                                              tmp_path: Path) -> None:
    # The built-in model and reward model of a run are committed in the store (the bucket for S3), so another node,
    # or this one after losing its cache, reads the same directories back instead of training new ones.
    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.bootstrap.reward_model import REWARD_MODEL, prepare_reward_model
    from marl_pipeline.bootstrap.tiny_model import BUILTIN_MODEL
    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import build_environment

    data = {**demo_config_data, "store": store_config.model_dump(),
            "reward_model": {"model": "builtin:tiny", "train_steps": 2}}
    data["agents"] = {name: {**agent, "warmup": {"steps": 0}} for name, agent in data["agents"].items()}
    config = parse_config(data)
    env = build_environment(config.environment.name, config.environment.options)
    writer = ExperienceStore(config.store)
    prepare_base_policies(config, env, writer)
    reward = prepare_reward_model(config, env, writer)
    assert writer.models.versions(config.run, BUILTIN_MODEL) == [0] == writer.models.versions(config.run, REWARD_MODEL)
    reader = _other_node(config.store, tmp_path, "node-b")
    for name in (BUILTIN_MODEL, REWARD_MODEL):
        ours, theirs = writer.models.fetch(config.run, name, 0), reader.models.fetch(config.run, name, 0)
        assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
    assert prepare_reward_model(config, env, reader) == reader.models.fetch(config.run, REWARD_MODEL, 0)
    assert (reward / "config.json").is_file()
    if config.store.uri.startswith("s3://"):  # nothing of the run is only in this node's cache
        shutil.rmtree(config.store.policy_cache)
        assert (ExperienceStore(config.store).models.fetch(config.run, REWARD_MODEL, 0) / "config.json").is_file()
