"""Data-driven retraining: the ``retrain_on_new_tasks`` sensor starts ``train`` when a batch of task files lands.

The experiment's ``retrain.watch`` is a directory or S3 prefix the environment reads its tasks from (for example
the directory of ``math_solver_verifier``'s ``task_file``). The sensor's cursor holds a fingerprint of every task
file it has accounted for (size, modification time, S3 ETag). Files new or changed since then are a batch; the
batch starts one run once its listing has stayed the same for ``retrain.settle_s``, so files still being copied
do not start one run per tick they straddle, and a batch that lands while ``train`` runs waits for that run to
end (two launches of one experiment at once would share its launch record). The run key is the batch's own
fingerprint: should the cursor be lost, Dagster still skips a run key it has already launched.
Task files present on the sensor's first tick are the baseline: data that lands afterwards is what retrains.
"""

import fnmatch
import hashlib
import json
import time

import dagster as dg

from assets.train import train_job
from resources import ExperimentResource

_RUNNING = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
            dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def task_files(config) -> dict[str, str]:
    """Every task file under the experiment's ``retrain.watch``: its URI -> a fingerprint of its content's version.

    An S3 prefix is read with the store's endpoint and keys (None there: the AWS_* chain); names starting with
    ``.`` are skipped, so a writer can upload under a hidden name and rename when done.
    """
    from marl_pipeline.store.storage import open_location

    retrain = config.retrain
    location = open_location(config.store.model_copy(update={"uri": retrain.watch}))
    if not location.fs.isdir(location.base):
        return {}
    files = {}
    for path, info in location.fs.find(location.base, detail=True).items():
        name = path.rsplit("/", 1)[-1]
        if name.startswith(".") or not fnmatch.fnmatch(name, retrain.pattern):
            continue
        modified = info.get("mtime", info.get("LastModified", ""))
        files[location.uri_of(path)] = f"{info.get('size')}:{modified}:{info.get('ETag', '')}"
    return files


# Targets the job by name: given the job itself, Definitions copies the sensor to bind the job's resources, and the
# copy trips a BetaWarning of dagster 1.13 (SensorDefinition's `owners`) every time the code location loads.
@dg.sensor(job_name=train_job.name, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Retrain when task files land under the experiment's `retrain.watch`: one run per batch.")
def retrain_on_new_tasks(context: dg.SensorEvaluationContext, experiment: ExperimentResource):
    config = experiment.load()
    if config.retrain.watch is None:
        return dg.SkipReason(f"run {config.run}: the experiment sets no retrain.watch")
    files = task_files(config)
    if context.cursor is None:
        return dg.SensorResult(skip_reason=f"baseline: {len(files)} task files under {config.retrain.watch}",
                               cursor=json.dumps({"seen": files}))
    cursor = json.loads(context.cursor)
    batch = {path: print_ for path, print_ in files.items() if cursor["seen"].get(path) != print_}
    if not batch:  # deleted files leave the cursor; they start nothing
        return dg.SensorResult(skip_reason="no new task files", cursor=json.dumps({"seen": files}))
    now = time.time()
    if batch != cursor.get("pending"):  # a new batch, or one still growing or being rewritten: wait for it to settle
        cursor.update(pending=batch, since=now)
    waited = now - cursor["since"]
    if waited < config.retrain.settle_s:
        return dg.SensorResult(skip_reason=f"{len(batch)} new task files, unchanged for {waited:.0f} s of "
                                           f"retrain.settle_s {config.retrain.settle_s:g}", cursor=json.dumps(cursor))
    running = context.instance.get_run_records(dg.RunsFilter(job_name=train_job.name, statuses=_RUNNING), limit=1)
    if running:
        return dg.SensorResult(skip_reason=f"{len(batch)} new task files wait for run {running[0].dagster_run.run_id} "
                                           f"to finish", cursor=json.dumps(cursor))
    digest = hashlib.sha256(json.dumps(batch, sort_keys=True).encode()).hexdigest()[:16]
    context.log.info(f"{len(batch)} new task files: {', '.join(sorted(batch))}")
    request = dg.RunRequest(run_key=f"tasks-{digest}", run_config=experiment.run_config(),
                            tags={"marl/trigger": "new task files", "marl/task_files": str(len(batch)),
                                  "marl/task_batch": digest})
    return dg.SensorResult(run_requests=[request], cursor=json.dumps({"seen": files}))


@dg.sensor(minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Mark failed the train-job runs shown as started whose process on this host died (a kill -9 "
                       "leaves no failure event), without waiting for the run's next launch.")
def mark_dead_launches(context: dg.SensorEvaluationContext):
    from assets.train import fail_dead_launches

    failed = fail_dead_launches(context.instance)
    return dg.SkipReason(f"marked failed: {', '.join(failed)}" if failed else "every started launch is alive")
