"""An engine and a trainer in one process or in two (issue 28.3: ``agents.<a>.hybrid``, cluster/hybrid.py).

Two loops on the demo's tiny model, each on one torch thread: bare vLLM generating 128 requests of 3 tokens, and
bare torch training 128 rows of 12 tokens (forward, backward, AdamW). They run, timed over the same window:

- ``alone``: each loop in a process of its own, one after the other (one core each, nothing beside it);
- ``one process``: the two loops on two threads of one process (they share the interpreter lock);
- ``two agents, hybrid``: two such processes at once (two agents, each engine and trainer in one process);
- ``two agents, apart``: four processes at once, one per loop (the layout with a trainer actor per agent).

    .venv/bin/python -m bench.pipeline.one_process MODEL_DIR [--seconds 12]

MODEL_DIR: a policy directory of the demo's tiny model (e.g. ``.marl/store/run=demo/policies/agent=solver/version=0``
after ``make train``). Prints each loop's rate and each process's CPU (cores) over the window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "ERROR", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def _engine_loop(model: str, seconds: float, ready: threading.Event, go: threading.Event, out: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_num_seqs=256, max_model_len=256,
              kv_cache_memory_bytes=2**27, seed=0)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(128)]
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10 + i % 50]} for i in range(128)]
    llm.generate(prompts, params, use_tqdm=False)
    ready.set()
    go.wait()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        llm.generate(prompts, params, use_tqdm=False)
        calls += 1
    out["engine calls/s"] = round(calls / (time.perf_counter() - started), 2)


def _trainer_loop(model: str, seconds: float, ready: threading.Event, go: threading.Event, out: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    ids = torch.randint(1, 200, (128, 12))

    def step() -> None:
        policy(ids).logits[:, -4:].log_softmax(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    ready.set()
    go.wait()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        step()
        steps += 1
    out["trainer steps/s"] = round(steps / (time.perf_counter() - started), 2)


def worker(loops: list[str], model: str, seconds: float, start_at: float) -> None:
    """Run ``loops`` on threads of this process, timed from ``start_at`` (wall clock); print one JSON line."""
    os.environ.update(ENV)
    targets = {"engine": _engine_loop, "trainer": _trainer_loop}
    go, out = threading.Event(), {}
    readies = [threading.Event() for _ in loops]
    threads = [threading.Thread(target=targets[name], args=(model, seconds, ready, go, out))
               for name, ready in zip(loops, readies)]
    for thread in threads:
        thread.start()
    for ready in readies:
        ready.wait()
    if time.time() > start_at:
        raise SystemExit(f"{loops} ready after the window's start: raise the lead time")
    time.sleep(start_at - time.time())
    cpu = time.process_time()
    go.set()
    for thread in threads:
        thread.join()
    print(json.dumps({"loops": "+".join(loops), **out, "cores": round((time.process_time() - cpu) / seconds, 2)}))


def together(groups: list[list[str]], model: str, seconds: float, lead: float = 45.0) -> list[dict]:
    """One process per group, all timed over the same window."""
    start_at = time.time() + lead
    processes = [subprocess.Popen([sys.executable, __file__, "--worker", ",".join(group), model,
                                   "--seconds", str(seconds), "--start-at", str(start_at)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for group in groups]
    return [json.loads(process.communicate()[0].strip().splitlines()[-1]) for process in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","), args.model, args.seconds, args.start_at)
        return
    cases = {"alone (engine)": [["engine"]], "alone (trainer)": [["trainer"]], "one process": [["engine", "trainer"]],
             "two agents, hybrid": [["engine", "trainer"]] * 2,
             "two agents, apart": [["engine"], ["trainer"], ["engine"], ["trainer"]]}
    print(f"{os.cpu_count()} cores; {args.seconds:g} s windows")
    for case, groups in cases.items():
        print(f"{case}: {together(groups, args.model, args.seconds)}", flush=True)


if __name__ == "__main__":
    main()
