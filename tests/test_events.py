"""What a launch tells its log about set-up facts, grouped so that each is said once."""

from __future__ import annotations

from marl_pipeline.run.events import TrainerPasses, describe_passes

CPU = {"passes": "padded", "padded_why": "padded: varlen attention runs on CUDA", "chunk_tokens": 2048,
       "budget_why": "the CPU's default", "head": "chunked", "device": "cpu", "dtype": "float32"}


def test_trainers_that_pass_alike_share_one_short_line() -> None:
    told = [TrainerPasses("verifier", 0, CPU), TrainerPasses("solver", 0, CPU)]
    assert describe_passes(told) == [
        "trainers of solver, verifier: padded passes of 2,048 tokens (the CPU's default) on cpu, float32"]


def test_trainers_that_pass_differently_get_a_line_each() -> None:
    gpu = {**CPU, "passes": "packed", "padded_why": None, "chunk_tokens": 65536,
           "budget_why": "sized to 60.0 GiB of H100", "device": "NVIDIA H100", "dtype": "bfloat16"}
    unsized = {**CPU, "chunk_tokens": None}
    assert describe_passes([TrainerPasses("solver", 0, gpu), TrainerPasses("verifier", 0, unsized),
                            TrainerPasses("judge", 0, CPU)]) == [
        "trainers of solver: packed passes of 65,536 tokens (sized to 60.0 GiB of H100) on NVIDIA H100, bfloat16",
        "trainers of verifier: padded passes (no pass ran to size their budget) on cpu, float32",
        "trainers of judge: padded passes of 2,048 tokens (the CPU's default) on cpu, float32"]
