"""A projection, not a measurement (issue 50.6): what this orchestrator's mechanisms would do on a FlexMARL-like
cluster, by the planner's simulation with roofline costs (planner/profiles.py). docs/scale.md reads its output.

    .venv/bin/python -m bench.planner.scale_projection --out /tmp/scale.json

48 nodes x 8 H100 (96 CPUs each). Three agents of unequal size and response length, one episode a planner turn, a
coder turn and a reviewer turn: a 7B-shaped planner (512-token prompts, responses of 64-1,024 tokens), a
3B-shaped coder (1,024-token prompts, a long tail of responses: 128-4,096 tokens, a quarter over 2,048) and a
1B-shaped reviewer (2,048-token prompts, 32-256-token responses). 64 prompts x 8 samples a micro-batch, 4
micro-batches a step. Layouts:

- synchronous, equal split: each agent 16 nodes, half its GPUs engine replicas and half trainer workers;
- streaming, agent-centric: the same GPUs split by each agent's share of the step's FLOPs, staleness 1;
- the planner's best found from the agent-centric layout (``--search``'s local search).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {  # Hugging Face config.json fields of the three shapes (Qwen2.5-7B, Llama-3.2-3B, Llama-3.2-1B)
    "planner": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                "tie_word_embeddings": False},
    "coder": {"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "vocab_size": 128256,
              "tie_word_embeddings": True},
    "reviewer": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                 "tie_word_embeddings": True},
}
NODES, GPUS, CPUS = 48, 8, 96


def _register() -> None:
    """The three roles as an environment the config validates against (the simulation runs no environment)."""
    from marl_pipeline.environment import register_environment

    @register_environment
    class ProjectionTeam:
        name = "projection_team"
        turn_order = ("planner", "coder", "reviewer")

        class Options(BaseModel):
            pass

        def _never(self, *args):
            raise NotImplementedError("a projection simulates its episodes: none runs")

        sample_tasks = render_prompt = score = execute = _never


def _episodes(count: int, seed: int = 0):
    from marl_pipeline.planner.costs import Turn

    rng = random.Random(seed)
    episodes = []
    for _ in range(count):
        coder = rng.randint(2048, 4096) if rng.random() < 0.25 else rng.randint(128, 2048)
        episodes.append([Turn("planner", 512, rng.randint(64, 1024)), Turn("coder", 1024, coder),
                         Turn("reviewer", 2048, rng.randint(32, 256))])
    return episodes


def _data(layout: dict[str, tuple[int, int, int]], mode: str, staleness: int) -> dict:
    """An experiment: each agent's (engine replicas, tensor parallel, trainer workers) on whole GPUs."""
    agents = {agent: {"model": f"shape-of-{agent}", "warmup": {"steps": 0},
                      "engine": {"replicas": replicas, "tensor_parallel_size": tp, "num_gpus": tp, "num_cpus": 4},
                      "trainer": {"workers": workers, "num_gpus": 1, "num_cpus": 4}}
              for agent, (replicas, tp, workers) in layout.items()}
    return {"run": "projection", "store": "/tmp/projection", "environment": {"name": "projection_team"},
            "agents": agents, "pipeline": {"steps": 3, "prompts_per_micro_batch": 64, "samples_per_prompt": 8,
                                           "micro_batches_per_step": 4, "mode": mode, "staleness": staleness}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/scale.json"))
    parser.add_argument("--search", action="store_true", help="Also search from the agent-centric layout.")
    parser.add_argument("--one-collective", action="store_true",
                        help="Sync each agent's replicas in one collective (its per-replica seconds divided by its "
                             "replicas), as ray.weight_sync: broadcast sends a version, each replica's own load "
                             "left out.")
    args = parser.parse_args()
    from marl_pipeline.config import parse_config
    from marl_pipeline.planner.plan import predict
    from marl_pipeline.planner.profiles import ModelShape, gpu, gpu_costs
    from marl_pipeline.planner.search import search

    _register()
    shapes = {agent: ModelShape.from_config(config) for agent, config in SHAPES.items()}
    episodes = _episodes(2048)
    nodes = [{"CPU": float(CPUS), "GPU": float(GPUS)} for _ in range(NODES)]

    def costs_for(config):
        costs = gpu_costs(shapes, gpu("h100"), {a: s.engine.tensor_parallel_size for a, s in config.agents.items()},
                          {a: s.trainer.workers for a, s in config.agents.items()}, episodes)
        if args.one_collective:
            trainers = {a: replace(t, sync_per_replica=t.sync_per_replica / config.agents[a].engine.replicas)
                        for a, t in costs.trainers.items()}
            costs = replace(costs, trainers=trainers)
        return costs

    # FLOPs a step per agent (2 x parameters a sampled token, 6 x a trained one): the agent-centric split
    flops = {agent: sum(8 * shapes[agent].parameters * (t.prompt_tokens + t.response_tokens)
                        for episode in episodes for t in episode if t.agent == agent) for agent in shapes}
    total = NODES * GPUS
    share = {agent: max(16, round(total * f / sum(flops.values()) / 16) * 16) for agent, f in flops.items()}
    while sum(share.values()) > total:
        share[max(share, key=share.get)] -= 16
    layouts = {
        "synchronous, equal split": (_data({a: (16, 4, 64) for a in shapes}, "synchronous", 0)),
        "streaming, agent-centric": (_data({a: (share[a] // 2 // 4, 4, share[a] // 2) for a in shapes},
                                           "streaming", 1)),
    }
    results = {"assumption": "a projection by simulation with roofline costs (planner/profiles.py), not a measurement",
               "gpu_share": share, "layouts": {}}
    for name, data in layouts.items():
        started = time.perf_counter()
        _, prediction = predict(parse_config(data), nodes, costs_for(parse_config(data)))
        results["layouts"][name] = {"step_seconds": prediction.mean_step_seconds, "bound": prediction.bound,
                                    "busy": prediction.busy, "staleness": prediction.staleness,
                                    "layout": {a: data["agents"][a] for a in shapes},
                                    "simulated_in_s": time.perf_counter() - started}
        print(f"{name}: {prediction.mean_step_seconds:.1f} s a step, bound by {prediction.bound} "
              f"({time.perf_counter() - started:.0f} s to simulate)", flush=True)
    if args.search:
        found = search(layouts["streaming, agent-centric"], nodes, costs_for, keep=3)
        results["search"] = [{"settings": c.settings(), "step_seconds": c.step_seconds, "bound": c.bound}
                             for c in found]
        print("best found:", found[0].step_seconds, found[0].settings())
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
