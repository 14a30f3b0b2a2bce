"""Pure math of the algorithm options (KL to a reference, entropy bonus, sequence normalisation, truncated importance
sampling, engine-vs-trainer mismatch, precision) against hand-derived values, and their wiring into the trainer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from marl_pipeline.policy import precision
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.losses import (
    entropy_from_log_probs,
    grpo_token_loss,
    k3_kl,
    loss_units,
    mismatch_stats,
    summed_loss,
    truncated_is_weights,
)
from marl_pipeline.training.trainer import PolicyTrainer

LN2 = math.log(2)


def test_k3_kl_by_hand() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.9)]])
    kl = k3_kl(logprobs, ref)
    # ref - logp = -ln2: 0.5 + ln2 - 1; ref - logp = +ln2: 2 - ln2 - 1; equal: 0
    assert kl.tolist()[0] == pytest.approx([LN2 - 0.5, 1 - LN2, 0.0], abs=1e-6)
    kl.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    assert logprobs.grad.tolist()[0] == pytest.approx([0.5, -1.0, 0.0], abs=1e-6)


def test_entropy_by_hand() -> None:
    log_probs = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]]))
    # 0.5 ln2 + 0.25 * 2 ln2 + 2 * 0.125 * 3 ln2 = 1.75 ln2 ; uniform over 4: ln4
    assert entropy_from_log_probs(log_probs).tolist() == pytest.approx([1.75 * LN2, 2 * LN2], abs=1e-6)


def _two_sequences():
    # Row 0: two response tokens; row 1: one (its second position is padding).
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.9), 0.0]])
    engine = torch.tensor([[math.log(0.25), math.log(0.2)], [math.log(0.9), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logprobs, engine, torch.tensor([1.0, -2.0]), mask


def test_grpo_loss_with_kl_and_entropy_by_hand_in_both_normalisations() -> None:
    logprobs, engine, advantages, mask = _two_sequences()
    ref = torch.tensor([[math.log(0.25), math.log(0.4)], [math.log(0.9), 5.0]])
    entropy = torch.tensor([[1.0, 0.5], [2.0, 9.0]])
    token_loss, _ = grpo_token_loss(logprobs, engine, advantages, 0.2, ref_logprobs=ref, kl_coef=0.1,
                                    entropy=entropy, entropy_coef=0.01)
    # policy gradient: ratio 2, A=+1 -> -1.2 ; ratio 1, A=+1 -> -1 ; ratio 1, A=-2 -> +2
    # k3: ln2 - 0.5 ; 1 - ln2 ; 0          entropy: 1.0 ; 0.5 ; 2.0
    expected = [[-1.2 + 0.1 * (LN2 - 0.5) - 0.01, -1.0 + 0.1 * (1 - LN2) - 0.005], [2.0 - 0.02]]
    assert token_loss[0].tolist() == pytest.approx(expected[0], abs=1e-6)
    assert token_loss[1, 0].item() == pytest.approx(expected[1][0], abs=1e-6)
    # token: the three terms summed (k3 terms add to 0.5), the step divides by 3 tokens
    assert summed_loss(token_loss, mask, "token").item() == pytest.approx(-0.2 + 0.05 - 0.035, abs=1e-6)
    assert loss_units(mask, "token") == 3
    # sequence: row 0's mean plus row 1's mean, the step divides by 2 sequences
    assert summed_loss(token_loss, mask, "sequence").item() == pytest.approx(
        (expected[0][0] + expected[0][1]) / 2 + expected[1][0], abs=1e-6)
    assert loss_units(mask, "sequence") == 2


def test_sequence_normalisation_weighs_sequences_not_tokens() -> None:
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert summed_loss(token_loss, mask, "token").item() == 10.0  # / 4 tokens = 2.5
    assert loss_units(mask, "token") == 4
    assert summed_loss(token_loss, mask, "sequence").item() == 2.0 + 4.0  # / 2 sequences = 3.0
    assert loss_units(mask, "sequence") == 2  # a row without response tokens counts for nothing


def test_truncated_importance_sampling_by_hand() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]], requires_grad=True)
    engine = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.9)]])
    weights = truncated_is_weights(logprobs, engine, cap=1.5)
    # trainer / engine = 2, 0.5, 1 -> capped at 1.5
    assert weights.tolist()[0] == pytest.approx([1.5, 0.5, 1.0], abs=1e-6)
    assert not weights.requires_grad
    token_loss, ratio = grpo_token_loss(logprobs, engine, torch.tensor([-2.0]), 0.2, tis_cap=1.5)
    # the clip's ratio is pi / sg(pi) = 1: never clipped; each term is -A * w
    assert ratio.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])
    assert token_loss.tolist()[0] == pytest.approx([3.0, 1.0, 2.0], abs=1e-6)
    token_loss.sum().backward()
    # gradient -A * w * d logp (the ratio 2 of the first token is not counted twice)
    assert logprobs.grad.tolist()[0] == pytest.approx([3.0, 1.0, 2.0], abs=1e-6)


def test_mismatch_statistics_by_hand() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9), 0.0]])
    engine = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.9), -30.0]])  # the last token is masked
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    stats = mismatch_stats(logprobs, engine, mask)
    # |diff| = ln2, ln2, 0 ; ratios 2, 0.5, 1 with mean 7/6, deviations 5/6, -2/3, -1/6 -> variance 7/18
    assert stats["mismatch_abs_logprob"] == pytest.approx(2 * LN2 / 3, abs=1e-6)
    assert stats["mean_ratio"] == pytest.approx(7 / 6, abs=1e-6)
    assert stats["mismatch_ratio_std"] == pytest.approx(math.sqrt(7 / 18), abs=1e-6)


def test_trainer_reports_no_mismatch_against_its_own_logprobs(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    prompts, responses = [[5, 6, 7], [9, 4]], [[8, 9], [3, 3, 2]]
    own = [trainer.completion_logprobs(p, r) for p, r in zip(prompts, responses)]
    stats = trainer.accumulate(TrainBatch(prompts, responses, own, [1.0, -1.0]))
    assert stats["mismatch_abs_logprob"] < 1e-6 and stats["mismatch_ratio_std"] < 1e-6
    shifted = [[lp - 0.1 for lp in row] for row in own]  # engine 0.1 nats below everywhere: ratio e^0.1, no spread
    stats = trainer.accumulate(TrainBatch(prompts, responses, shifted, [1.0, -1.0]))
    assert stats["mismatch_abs_logprob"] == pytest.approx(0.1, abs=1e-5)
    assert stats["mean_ratio"] == pytest.approx(math.exp(0.1), abs=1e-5)
    assert stats["mismatch_ratio_std"] < 1e-5


def test_kl_reference_is_loaded_only_with_a_penalty(tiny_model_dir: Path) -> None:
    common = dict(lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0, num_threads=1)
    assert PolicyTrainer(str(tiny_model_dir), 0, reference_dir=str(tiny_model_dir), **common).reference is None
    with pytest.raises(ValueError, match="reference_dir"):
        PolicyTrainer(str(tiny_model_dir), 0, kl_coef=0.1, **common)
    trainer = PolicyTrainer(str(tiny_model_dir), 0, kl_coef=0.1, reference_dir=str(tiny_model_dir), **common)
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    # reference == policy: k3 is 0 and so is its gradient, the loss is the policy gradient's alone
    plain = PolicyTrainer(str(tiny_model_dir), 0, **common)
    batch = TrainBatch([[5, 6, 7]], [[8, 9]], [[-1.0, -2.0]], [1.0])
    assert trainer.accumulate(batch)["loss_sum"] == pytest.approx(plain.accumulate(batch)["loss_sum"], abs=1e-6)


def test_cpu_bf16_detection_reads_the_flags(tmp_path: Path, monkeypatch) -> None:
    amx, avx2 = tmp_path / "amx", tmp_path / "avx2"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_tile amx_bf16\n")
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert precision.cpu_has_bf16(amx) and not precision.cpu_has_bf16(avx2)
    named = tmp_path / "named"
    named.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx512_bf16\n")
    assert precision.cpu_name(named) == "AMD EPYC 9B14" and precision.cpu_name(avx2) == "unknown"
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.resolve_dtype("auto", "cpu") == torch.float32
    assert precision.resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_bf16_trainer_keeps_float32_weights_and_close_logprobs(tiny_model_dir: Path) -> None:
    common = dict(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0, num_threads=1)
    fp32 = PolicyTrainer(str(tiny_model_dir), 0, **common)
    bf16 = PolicyTrainer(str(tiny_model_dir), 0, dtype="bfloat16", **common)
    prompt, response = [5, 6, 7], [8, 9, 10]
    before = fp32.completion_logprobs(prompt, response)
    assert bf16.completion_logprobs(prompt, response) == pytest.approx(before, abs=0.05)
    bf16.accumulate(TrainBatch([prompt], [response], [before], [1.0]))
    bf16.apply_step()
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert sum(bf16.completion_logprobs(prompt, response)) > sum(before)


def test_trainer_options_carry_the_algorithm_and_precision(demo_config_data: dict, tmp_path: Path) -> None:
    from marl_pipeline.cluster.specs import BASE_POLICY, trainer_options
    from marl_pipeline.config import parse_config

    default = parse_config({**demo_config_data, "store": str(tmp_path / "store")})
    options = trainer_options(default.agent_slice("solver"))
    assert (options["kl_coef"], options["reference_dir"], options["entropy_coef"], options["tis_cap"]) == (
        0.0, None, 0.0, None)
    assert (options["loss_normalization"], options["dtype"]) == ("token", "float32")
    agents = {name: {**agent, "trainer": {**agent.get("trainer", {}), "dtype": "auto"}}
              for name, agent in demo_config_data["agents"].items()}
    config = parse_config({**demo_config_data, "store": str(tmp_path / "store"), "agents": agents,
                           "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.001, "loss_normalization": "sequence",
                                         "tis_cap": 2.0}})
    options = trainer_options(config.agent_slice("solver"))
    assert options["reference_dir"] == BASE_POLICY  # version 0, fetched where the trainer is built
    assert (options["kl_coef"], options["entropy_coef"], options["loss_normalization"], options["tis_cap"],
            options["dtype"]) == (0.05, 0.001, "sequence", 2.0, "auto")


def test_mismatch_columns_are_stored_summarised_and_optional_in_older_partitions(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from marl_pipeline.stages.training import updates_table
    from marl_pipeline.store import ExperienceStore, MicroBatchKey
    from marl_pipeline.store.summaries import stage_summary

    store, key = ExperienceStore(tmp_path / "store"), MicroBatchKey("r", 0, 0)
    stats = {"rows": 2, "tokens": 5, "loss_sum": 0.5, "policy_version": 0, "clip_fraction": 0.0, "mean_ratio": 1.0,
             "mismatch_abs_logprob": 0.25, "mismatch_ratio_std": 0.125}
    verifier = {**stats, "mismatch_abs_logprob": 0.5}
    store.commit("policy_updates", key, updates_table({"solver": stats, "verifier": verifier}))
    summary = stage_summary("policy_updates", store.read("policy_updates", key))
    assert summary["mismatch_abs_logprob/solver"] == 0.25 and summary["mismatch_abs_logprob/verifier"] == 0.5
    assert summary["mismatch_ratio_std/solver"] == 0.125
    # a partition written before the columns existed: they read back null and the summary leaves them out
    partition = Path(store.partition_path("policy_updates", key))
    for name in store.manifest("policy_updates", key).files.values():
        table = pq.read_table(partition / name)
        pq.write_table(table.drop_columns(["mismatch_abs_logprob", "mismatch_ratio_std"]), partition / name)
    older = store.read("policy_updates", key)
    assert older.column("mismatch_abs_logprob").null_count == 2
    assert not any(name.startswith("mismatch") for name in stage_summary("policy_updates", older))
    # and a producer may leave them out of a commit
    store.commit("policy_updates", key, older.drop_columns(["mismatch_abs_logprob", "mismatch_ratio_std"]))


def test_the_engines_auto_dtype_asks_the_trainers_hardware_check(monkeypatch) -> None:
    from marl_pipeline.inference.engine import engine_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for has_bf16, expected in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda has_bf16=has_bf16: has_bf16)
        assert engine_dtype("auto") == expected
    assert engine_dtype("float32") == "float32" and engine_dtype("bfloat16") == "bfloat16"
