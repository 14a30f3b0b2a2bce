"""The ``train`` job: one streaming orchestrator run, recorded into Dagster as it goes.

Dagster stays on the control plane: the orchestrator moves data through the store on Ray, and this op
turns each commit into an ``AssetMaterialization`` of that stage partition (about 2 ms each) the
moment it lands, so the UI's partition grid fills in live.
"""


import dagster as dg

from assets.metadata import stage_metadata
from assets.partitions import AGENTS, STEPS, agent_key, stage_partition, step_key
from assets.policies import base_policy_metadata
from resources import ExperimentResource, RayCluster


@dg.op(description="Stream micro-batches through rollout, environment, reward and train on Ray.")
def stream_training(context: dg.OpExecutionContext, experiment: ExperimentResource, ray: RayCluster) -> None:
    from marl_pipeline.orchestrator import PolicyCommitted, StageCommitted, StepFinished, mean_reward
    from marl_pipeline.recipe import RunStarted, train

    config = experiment.load()
    instance = context.instance
    instance.add_dynamic_partitions(AGENTS.name, [agent_key(config.run, agent) for agent in config.agents])
    for event in train(config):
        if isinstance(event, StageCommitted):
            key = event.key
            context.log_event(dg.AssetMaterialization(
                asset_key=event.stage, partition=stage_partition(key.run, key.step, key.micro_batch),
                metadata=stage_metadata(event.stage, event.path, event.seconds, event.table)))
        elif isinstance(event, PolicyCommitted):
            context.log_event(dg.AssetMaterialization(
                asset_key="policies", partition=agent_key(config.run, event.agent),
                metadata={"policy_version": event.version, "step": event.step,
                          "path": dg.MetadataValue.path(str(event.path)), "grad_norm": event.grad_norm,
                          "tokens": event.tokens}))
        elif isinstance(event, StepFinished):
            rewards = ", ".join(f"{agent} {value:.3f}" for agent, value in event.mean_reward.items())
            context.log.info(f"step {event.step}: mean reward {mean_reward(event.mean_reward):.3f} ({rewards}), "
                             f"{event.seconds:.2f} s")
        elif isinstance(event, RunStarted):
            instance.add_dynamic_partitions(
                STEPS.name, [step_key(config.run, step) for step in range(event.first_step, event.last_step + 1)])
            if any(policy.created for policy in event.base_policies):
                context.log_event(dg.AssetMaterialization(asset_key="base_policies",
                                                          metadata=base_policy_metadata(event.base_policies)))
            where = "a new run" if event.first_step == 0 else f"resuming from policy version {event.first_step}"
            context.log.info(f"run {event.run}: steps {event.first_step}..{event.last_step}, {where}; "
                             f"set-up took {event.setup_seconds:.1f} s")


@dg.job(name="train", description="Train every agent for `pipeline.steps` RL steps, continuing from the latest "
                                   "committed policies.")
def train_job():
    stream_training()


retrain_schedule = dg.ScheduleDefinition(
    name="retrain",
    job=train_job,
    cron_schedule="0 */6 * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Periodic retraining: each tick continues from the latest committed policies.",
)
