"""The planner's costs for GPUs without a stored run (marl_pipeline/planner/profiles.py): rooflines from stated
figures, a measured trainer profile, a model's shape from its config. Arithmetic only: no GPU."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from marl_pipeline.planner.costs import Turn
from marl_pipeline.planner.profiles import (
    GPUS,
    GpuSpec,
    ModelShape,
    engine_roofline,
    gpu,
    gpu_costs,
    trainer_profile,
    trainer_roofline,
)

# A made-up model: 16 layers of 8 key/value heads of 64, so a token's KV cache in bf16 is
# 2 (key, value) x 16 x 8 x 64 x 2 bytes = 32,768 bytes.
SHAPE = ModelShape(parameters=10**9, layers=16, hidden=2048, kv_heads=8, head_dim=64, vocab=32000)
H100 = GPUS["h100"]

# Llama-3.2-1B's config.json (the keys the shape reads).
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "tie_word_embeddings": True}


def test_the_engine_roofline_on_an_h100_matches_the_hand_derived_figures() -> None:
    # H100: 989e12 FLOP/s, 3.35e12 B/s; efficiency 0.6, so 2.01e12 B/s and 5.934e14 FLOP/s usable.
    # step: 1e9 parameters x 2 bytes / 2.01e12 = 9.950249e-4 s.
    # per sequence: KV read 1,024 tokens x 32,768 bytes = 33,554,432 bytes / 2.01e12 = 1.669375e-5 s, against
    # 2e9 FLOPs / 5.934e14 = 3.370408e-6 s: the read is the larger.
    # per prompt token: 2e9 / 5.934e14 = 3.370408e-6 s.
    costs = engine_roofline(SHAPE, H100)
    assert costs.step == pytest.approx(9.950249e-4, rel=1e-6)
    assert costs.per_sequence == pytest.approx(1.669375e-5, rel=1e-6)
    assert costs.per_prompt_token == pytest.approx(3.370408e-6, rel=1e-6)


def test_a_long_context_makes_the_kv_read_and_a_short_one_the_compute_the_per_sequence_cost() -> None:
    # context 0: no KV read, the 2e9 FLOPs alone (3.370408e-6 s); context 8,192: 8 x 1.669375e-5 = 1.335500e-4 s.
    assert engine_roofline(SHAPE, H100, context_tokens=0).per_sequence == pytest.approx(3.370408e-6, rel=1e-6)
    assert engine_roofline(SHAPE, H100, context_tokens=8192).per_sequence == pytest.approx(1.335500e-4, rel=1e-6)


def test_tensor_parallel_halves_the_fixed_decode_part() -> None:
    one, two = engine_roofline(SHAPE, H100), engine_roofline(SHAPE, H100, tensor_parallel=2)
    assert two.step == pytest.approx(one.step / 2)
    assert two.per_prompt_token == pytest.approx(one.per_prompt_token / 2)
    assert two.per_sequence == pytest.approx(one.per_sequence / 2)  # 8 key/value heads split over 2 devices


def test_key_value_heads_split_over_no_more_devices_than_there_are_heads() -> None:
    # 2 key/value heads at tensor parallel 8: the KV read splits 2 ways, the weights' read 8 ways.
    shape = ModelShape(parameters=10**9, layers=16, hidden=2048, kv_heads=2, head_dim=64, vocab=32000)
    one, eight = engine_roofline(shape, H100), engine_roofline(shape, H100, tensor_parallel=8)
    assert eight.step == pytest.approx(one.step / 8)
    assert eight.per_sequence == pytest.approx(one.per_sequence / 2)


def test_weights_larger_than_the_devices_memory_are_refused() -> None:
    # 7e10 parameters x 2 bytes = 130 GiB: over one H100's 80 GiB, within two.
    shape = ModelShape(parameters=7 * 10**10, layers=80, hidden=8192, kv_heads=8, head_dim=128, vocab=128256)
    with pytest.raises(ValueError, match="h100's 80 GiB"):
        engine_roofline(shape, H100)
    assert engine_roofline(shape, H100, tensor_parallel=2).step > 0


def test_the_trainer_roofline_on_an_h100_matches_the_hand_derived_figures() -> None:
    # per token: 6e9 FLOPs / (989e12 x 0.4 = 3.956e14) = 1.516684e-5 s.
    # apply: 28 bytes x 1e9 / 3.35e12 = 8.358209e-3 s.
    # sync: 1e9 float32 weights = 4e9 bytes / 25e9 B/s = 0.16 s.
    costs = trainer_roofline(SHAPE, H100)
    assert costs.call == 0.05
    assert costs.per_token == pytest.approx(1.516684e-5, rel=1e-6)
    assert costs.apply == pytest.approx(8.358209e-3, rel=1e-6)
    assert costs.sync_per_replica == pytest.approx(0.16)
    assert costs.commit == 0.0


def test_a_tied_embedding_is_sent_under_both_its_names() -> None:
    # the head's 32,000 x 2,048 = 65,536,000 parameters again: 1,065,536,000 x 4 bytes / 25e9 = 0.17048576 s.
    tied = ModelShape(parameters=10**9, layers=16, hidden=2048, kv_heads=8, head_dim=64, vocab=32000, tied=True)
    assert trainer_roofline(tied, H100).sync_per_replica == pytest.approx(0.17048576)


def test_more_workers_divide_the_training_time_a_token_and_the_optimizer_step() -> None:
    one, four = trainer_roofline(SHAPE, H100), trainer_roofline(SHAPE, H100, workers=4)
    assert four.per_token == pytest.approx(one.per_token / 4)
    assert four.apply == pytest.approx(one.apply / 4)
    assert four.sync_per_replica == one.sync_per_replica
    assert trainer_roofline(SHAPE, H100, mfu=0.2).per_token == pytest.approx(2 * one.per_token)


def test_an_unknown_gpu_name_is_refused_with_the_known_ones() -> None:
    assert gpu(" H200 ") is GPUS["h200"]
    with pytest.raises(ValueError, match="unknown GPU 'b200': known ones are a100, h100, h200"):
        gpu("b200")


def test_a_llama_3_2_1b_config_gives_its_parameter_count(tmp_path: Path) -> None:
    # embedding 128,256 x 2,048 = 262,668,288 (tied: once); a layer: q and o 2 x 2,048 x 2,048, k and v
    # 2 x 2,048 x 512, the MLP 3 x 2,048 x 8,192, two norms 2 x 2,048 = 60,821,504, x 16 = 973,144,064; the final
    # norm 2,048: 1,235,814,400 in all.
    shape = ModelShape.from_config(LLAMA_1B)
    assert shape.parameters == pytest.approx(1.24e9, rel=0.02)
    assert shape.parameters == 1_235_814_400
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.head_dim, shape.vocab, shape.tied) == (
        16, 2048, 8, 64, 128256, True)
    assert shape.kv_bytes_per_token() == 32768
    untied = ModelShape.from_config({**LLAMA_1B, "tie_word_embeddings": False})
    assert untied.parameters - shape.parameters == 128256 * 2048
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    assert ModelShape.from_config(tmp_path) == ModelShape.from_config(tmp_path / "config.json") == shape


def test_a_config_without_a_head_dim_divides_the_hidden_size_among_the_heads() -> None:
    config = {key: value for key, value in LLAMA_1B.items() if key != "head_dim"}
    assert ModelShape.from_config(config).head_dim == 64


def test_a_config_missing_a_key_or_of_experts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({key: value for key, value in LLAMA_1B.items() if key != "vocab_size"}))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} has no vocab_size"):
        ModelShape.from_config(path)
    with pytest.raises(ValueError, match="mixture of experts"):
        ModelShape.from_config({**LLAMA_1B, "num_local_experts": 8})


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


BENCHMARK = {"gpu": "NVIDIA H200", "torch": "2.11.0", "tokens": 50797, "response_tokens": 34413, "peak_tflops": 780.0,
             "runs": [{"model": "llama-1b", "checkpointing": False, "variant": "bound", "mfu": 0.432},
                      {"model": "llama-1b", "checkpointing": False, "variant": "default", "mfu": 0.507},
                      {"model": "llama-1b", "checkpointing": True, "variant": "default", "mfu": 0.412},
                      {"model": "qwen2.5-3b", "checkpointing": False, "variant": "default",
                       "error": "OutOfMemoryError"}]}


def test_a_benchmark_profile_gives_its_mfu_of_the_stated_peak(tmp_path: Path) -> None:
    # 0.507 of a measured 780 TFLOP/s against the H200's stated 989: 0.507 x 780 / 989 = 0.399858.
    path = _write(tmp_path, BENCHMARK)
    assert trainer_profile(path) == pytest.approx(0.399858, rel=1e-5)
    # with checkpointing: 0.412 x 780 / 989 = 0.324934.
    assert trainer_profile(path, checkpointing=True, model="llama-1b") == pytest.approx(0.324934, rel=1e-5)
    costs = trainer_roofline(SHAPE, GPUS["h100"], mfu=trainer_profile(path))
    assert costs.per_token == pytest.approx(6e9 / (989e12 * 0.507 * 780 / 989), rel=1e-9)


def test_a_plain_profile_gives_its_mfu_in_percent_or_as_a_fraction(tmp_path: Path) -> None:
    assert trainer_profile(_write(tmp_path, {"mfu": 41.2})) == pytest.approx(0.412)
    assert trainer_profile(_write(tmp_path, {"mfu": 0.412})) == pytest.approx(0.412)


def test_a_malformed_profile_is_refused_naming_the_file_and_what_is_missing(tmp_path: Path) -> None:
    path = _write(tmp_path, {"seconds": 1.2})
    with pytest.raises(ValueError, match=f"trainer profile {re.escape(str(path))} has neither 'runs'.*nor 'mfu'"):
        trainer_profile(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"trainer profile {re.escape(str(path))}: not a readable JSON file"):
        trainer_profile(path)
    path = _write(tmp_path, {"mfu": "high"})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: 'mfu' is 'high', not a positive number"):
        trainer_profile(path)
    path = _write(tmp_path, {key: value for key, value in BENCHMARK.items() if key != "peak_tflops"})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} has runs but no 'peak_tflops'"):
        trainer_profile(path)


def test_a_benchmark_profile_without_the_run_asked_for_or_of_an_unknown_gpu_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, BENCHMARK)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} has no run .* model qwen2.5-3b.*no mfu"):
        trainer_profile(path, model="qwen2.5-3b")
    path = _write(tmp_path, {**BENCHMARK, "gpu": "NVIDIA H100 PCIe"})
    with pytest.raises(ValueError, match="pass gpu="):
        trainer_profile(path)
    # with the part's stated peak given: 0.507 x 780 / 756 = 0.523095.
    pcie = GpuSpec("h100-pcie", bf16_tflops=756.0, bandwidth_tb_s=2.0, memory_gib=80.0)
    assert trainer_profile(path, gpu=pcie) == pytest.approx(0.523095, rel=1e-5)
    several = {**BENCHMARK, "runs": [*BENCHMARK["runs"], {"model": "qwen2.5-3b", "checkpointing": False,
                                                            "variant": "default", "mfu": 0.45}]}
    with pytest.raises(ValueError, match=re.escape("several models (llama-1b, qwen2.5-3b)")):
        trainer_profile(_write(tmp_path, several))


def test_gpu_costs_build_every_agents_costs_and_say_where_they_come_from(tmp_path: Path) -> None:
    llama = ModelShape.from_config(LLAMA_1B)
    agents = {"solver": llama, "verifier": SHAPE}
    episodes = [[Turn("solver", 256, 512), Turn("verifier", 300, 8)]]
    costs = gpu_costs(agents, H100, tensor_parallel={"solver": 2}, workers={"verifier": 4}, episodes=episodes)
    assert costs.source == "roofline on h100"
    assert costs.engines["solver"] == engine_roofline(llama, H100, tensor_parallel=2)
    assert costs.engines["verifier"] == engine_roofline(SHAPE, H100)
    assert costs.trainers["verifier"] == trainer_roofline(SHAPE, H100, workers=4)
    assert costs.trainers["solver"] == trainer_roofline(llama, H100)
    assert (costs.environment, costs.reward, costs.rollout_overhead, costs.train_overhead) == (0.0, 0.0, 0.0, 0.0)
    assert costs.episodes == episodes

    path = _write(tmp_path, BENCHMARK)
    measured = gpu_costs(agents, H100, {}, {}, episodes, mfu=trainer_profile(path), source_note=str(path))
    assert measured.source == f"trainer profile {path} (MFU 40.0%), roofline on h100"
    assert measured.trainers["solver"] == trainer_roofline(llama, H100, mfu=trainer_profile(path))
    with pytest.raises(ValueError, match="turns of critic, which have no model shape"):
        gpu_costs(agents, H100, {}, {}, [[Turn("critic", 10, 10)]])
    with pytest.raises(ValueError, match="mfu has no figure for verifier"):
        gpu_costs(agents, H100, {}, {}, episodes, mfu={"solver": 0.4})


def test_the_selector_grows_parallelism_only_where_the_smaller_one_stops_fitting() -> None:
    """EARL's selector on Llama-3.2-1B's shape and an 8B-like one: each range's choice fits at its longest context,
    and the next range begins exactly where the smaller choice stops fitting (its end + 1 does not fit)."""
    from marl_pipeline.planner.profiles import gpu
    from marl_pipeline.planner.selector import describe, engine_fits, parallelism_by_length, trainer_fits

    h100 = gpu("h100")
    big = {**LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "head_dim": 128, "tie_word_embeddings": False}  # about 8B parameters
    for config, sequences in ((LLAMA_1B, 256), (big, 64)):
        shape = ModelShape.from_config(config)
        ranges = parallelism_by_length(config, h100, sequences)
        assert ranges[-1].up_to == 1 << 17 and [r.up_to for r in ranges] == sorted({r.up_to for r in ranges})
        for previous, current in itertools.pairwise(ranges):
            assert (previous.tensor_parallel, previous.trainer_workers) != (current.tensor_parallel,
                                                                            current.trainer_workers)
            if previous.tensor_parallel is not None and previous.tensor_parallel != current.tensor_parallel:
                assert engine_fits(shape, h100, previous.tensor_parallel, previous.up_to, sequences)
                assert not engine_fits(shape, h100, previous.tensor_parallel, previous.up_to + 1, sequences)
            if previous.trainer_workers is not None and previous.trainer_workers != current.trainer_workers:
                assert trainer_fits(config, shape, h100, previous.trainer_workers, previous.up_to)
                assert not trainer_fits(config, shape, h100, previous.trainer_workers, previous.up_to + 1)
        assert ranges[0].tensor_parallel == 1  # a short context needs no split
        engines = [r.tensor_parallel for r in ranges if r.tensor_parallel is not None]
        assert engines == sorted(engines) and engines[-1] > 1  # 128k tokens of 64-256 sequences: split
    eight_b = parallelism_by_length(big, h100, 64)
    assert eight_b[0].trainer_workers == 2  # 8B's float32 weights and AdamW moments: more than one H100's 80 GiB
    assert describe(eight_b)[0].startswith("1-") and "tensor parallel 1, 2 trainer workers" in describe(eight_b)[0]
    # What a run applies between steps: the ranges as agents.<a>.parallelism_by_length, each range's longest
    # context laid out as the selector chose.
    from marl_pipeline.config import AgentConfig
    from marl_pipeline.planner.selector import layout_entries

    fitting = [r for r in eight_b if r.tensor_parallel is not None and r.trainer_workers is not None]
    agent = AgentConfig(engine={"num_gpus": 1}, trainer={"num_gpus": 1}, parallelism_by_length=layout_entries(eight_b))
    assert len(agent.parallelism_by_length) == len(fitting) and agent.layout_at(0) == 0
    for index, entry in enumerate(fitting):
        laid = agent.laid_out(agent.layout_at(entry.up_to))
        assert (laid.engine.tensor_parallel_size, laid.engine.num_gpus, laid.trainer.workers) == (
            entry.tensor_parallel, entry.tensor_parallel, entry.trainer_workers)
        assert agent.layout_at(entry.up_to + 1) == min(index + 1, len(fitting) - 1)
