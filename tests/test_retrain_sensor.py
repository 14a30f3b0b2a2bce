"""The ``retrain_on_new_tasks`` sensor, evaluated tick by tick on a real Dagster instance over a real directory and
a real S3 server (moto): each batch of task files requests exactly one ``train`` run, nothing new requests none.
No training runs here: a run request is the sensor's whole output."""

import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml

from assets.definitions import defs
from assets.retrain import retrain_on_new_tasks
from resources import ExperimentResource

TASK = '{"question": "Ann has 1 apple and gets 2 more. How many apples?", "answer": 3}\n'


class Watched:
    """An experiment watching a task directory (local or S3), and the sensor ticking over it with its cursor."""

    def __init__(self, tmp_path: Path, demo_config_data: dict, s3_endpoint: str | None = None, settle_s: float = 0):
        store: str | dict = str(tmp_path / "store")
        if s3_endpoint:
            store = {"uri": f"s3://marl/{tmp_path.name}/store", "endpoint_url": s3_endpoint, "region": "us-east-1",
                     "access_key_id": "testing", "secret_access_key": "testing", "policy_cache": str(tmp_path / "c")}
            self.watch = f"s3://marl/{tmp_path.name}/tasks"
            import s3fs

            self.fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_endpoint,
                                        client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True,
                                        use_listings_cache=False)
        else:
            self.watch, self.fs = str(tmp_path / "tasks"), None
            (tmp_path / "tasks").mkdir()
        config_path = tmp_path / "experiment.yaml"
        config_path.write_text(yaml.safe_dump({**demo_config_data, "store": store,
                                               "retrain": {"watch": self.watch, "settle_s": settle_s}}))
        self.experiment = ExperimentResource(config_path=str(config_path), overrides={"pipeline": {"steps": 3}})
        (tmp_path / "dagster_home").mkdir()
        self.instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster_home"))
        self.cursor: str | None = None

    def drop(self, *names: str, text: str = TASK) -> None:
        for name in names:
            if self.fs is not None:
                self.fs.pipe(f"{self.watch.removeprefix('s3://')}/{name}", text.encode())
            else:
                Path(self.watch, name).write_text(text)

    def tick(self) -> list[dg.RunRequest]:
        context = dg.build_sensor_context(instance=self.instance, cursor=self.cursor,
                                          resources={"experiment": self.experiment})
        result = retrain_on_new_tasks.evaluate_tick(context)
        self.cursor = result.cursor
        return result.run_requests


@pytest.fixture(params=["local", "s3"])
def watched(request, tmp_path: Path, demo_config_data: dict) -> Watched:
    endpoint = request.getfixturevalue("s3_endpoint") if request.param == "s3" else None
    return Watched(tmp_path, demo_config_data, endpoint)


@pytest.mark.launch
def test_a_batch_of_task_files_starts_exactly_one_run(watched: Watched) -> None:
    watched.drop("old.jsonl")
    assert watched.tick() == []  # the first tick takes what is there as the baseline
    assert watched.tick() == []  # no new files: no run
    watched.drop("batch1-a.jsonl", "batch1-b.jsonl", "batch1-c.jsonl", ".batch1-d.jsonl.partial")
    [request] = watched.tick()
    assert request.tags["marl/task_files"] == "3"  # the hidden, still-uploading file is not a task file yet
    # The run trains the experiment the sensor watched, overrides included, and its config is valid for `train`.
    config = request.run_config["resources"]["experiment"]["config"]
    assert ExperimentResource(**config).load().pipeline.steps == 3
    assert dg.validate_run_config(defs.get_job_def("train"), request.run_config)
    assert watched.tick() == [] and watched.tick() == []  # the same files never start another run

    watched.drop("batch1-a.jsonl", text=TASK * 2)  # a task file rewritten is new data too
    watched.drop("batch2.jsonl")
    [second] = watched.tick()
    assert second.tags["marl/task_files"] == "2" and second.run_key != request.run_key
    assert watched.tick() == []


@pytest.mark.launch
def test_a_batch_waits_for_its_files_to_settle_and_for_a_running_train(tmp_path: Path,
                                                                         demo_config_data: dict) -> None:
    watched = Watched(tmp_path, demo_config_data, settle_s=1.0)
    assert watched.tick() == []
    watched.drop("a.jsonl")
    assert watched.tick() == []  # just landed: the batch may still be growing
    watched.drop("b.jsonl")
    assert watched.tick() == []  # it grew: the settle time starts again
    time.sleep(1.1)
    running = dg.DagsterRun(job_name="train", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    watched.instance.add_run(running)
    assert watched.tick() == []  # settled, but two launches of one experiment must not overlap
    watched.instance.delete_run(running.run_id)
    [request] = watched.tick()
    assert request.tags["marl/task_files"] == "2"  # both files, one run
    assert watched.tick() == []


def test_an_experiment_without_a_watch_starts_nothing(tmp_path: Path, demo_config_data: dict) -> None:
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store")}))
    context = dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(),
                                      resources={"experiment": ExperimentResource(config_path=str(config_path))})
    result = retrain_on_new_tasks.evaluate_tick(context)
    assert result.run_requests == [] and "no retrain.watch" in result.skip_message
