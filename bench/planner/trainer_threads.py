"""What a trainer's second (and further) thread buys on the built-in tiny model, the planner bench's model: the thread
profile bench/planner/planner.py measures before it writes its predictions (``marl profile threads`` measures one for an
experiment's own agent; both through marl_pipeline/planner/profiling.py).

    .venv/bin/python -m bench.planner.trainer_threads --threads 1 2 --reps 9 --out threads.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rows", type=int, default=256, help="rows a micro-batch (the demo's: 16 prompts x 16)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(3, 8), metavar=("MIN", "MAX"))
    parser.add_argument("--response-tokens", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"))
    parser.add_argument("--out", type=Path, required=True, help="where to write the thread profile")
    args = parser.parse_args()

    from bench.engines.training import tiny_model
    from bench.planner.planner import base_config
    from marl_pipeline.cluster.specs import trainer_options
    from marl_pipeline.config import parse_config
    from marl_pipeline.planner.profiling import synthetic_batch, trainer_threads

    model = tiny_model(Path(tempfile.mkdtemp()))
    config = parse_config({**base_config("pair"), "run": "threads", "store": tempfile.mkdtemp()})
    options = trainer_options(config.agent_slice(next(iter(config.agents))), 1)  # the bench's trainer settings
    options |= {key: str(model) for key in ("reference_dir", "base_dir") if options[key]}
    batch = synthetic_batch(args.rows, 200, tuple(args.prompt_tokens), tuple(args.response_tokens))
    found = trainer_threads(model, options, batch, args.threads, args.reps)
    print("| threads | median s (accumulate + apply_step) | speed-up over 1 | cores kept busy |")
    print("| --- | --- | --- | --- |")
    for count in map(str, args.threads):
        print(f"| {count} | {found['seconds'][count]:.3f} | {found['trainer'][count]:.2f} | "
              f"{found['cores_busy'][count]:.2f} |")
    args.out.write_text(json.dumps(found, indent=1))
    print(f"thread profile written to {args.out}")


if __name__ == "__main__":
    main()
