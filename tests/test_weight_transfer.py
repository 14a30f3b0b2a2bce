"""Weight broadcast's torch side (policy/transfer.py): tensors of any dtype packed into byte buckets and read back
as views, a real gloo broadcast from one sender to several receivers in this process, a membership remade on the
same sender, and the settings a broadcast cannot run with refused."""

from __future__ import annotations

import threading

import pytest
import torch

from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.policy.transfer import Endpoint, SyncGroup, pack, unpack


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [("embed", torch.randn(7, 5, generator=generator)),
            ("norm", torch.randn(5, generator=generator).to(torch.bfloat16)),
            ("steps", torch.tensor([3, 1, 4], dtype=torch.int64)),
            ("scale", torch.tensor(0.5, dtype=torch.float64)),
            ("empty", torch.empty(0, 4)),
            ("head", torch.randn(3, 11, generator=generator).to(torch.float16))]


def _same(received: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]]) -> bool:
    return [name for name, _ in received] == [name for name, _ in sent] and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(received, sent))


@pytest.mark.parametrize("bucket_bytes", [1, 100, 2**20])
def test_tensors_of_any_dtype_pack_into_buckets_and_read_back_bit_for_bit_as_views(bucket_bytes: int) -> None:
    weights = _weights()
    layout, buckets = pack(weights, torch.device("cpu"), bucket_bytes)
    assert all(bucket.dtype == torch.uint8 for bucket in buckets)
    plans = layout.buckets(bucket_bytes)
    assert len(plans) == len(buckets) and sorted(index for plan in plans for index, _ in plan) == list(range(6))
    # no bucket holds more than its limit, unless one tensor alone is larger
    assert all(len(plan) == 1 or bucket.numel() <= bucket_bytes for plan, bucket in zip(plans, buckets))
    unpacked = unpack(layout, buckets, bucket_bytes)
    assert _same(unpacked, weights)
    weights[0][1].add_(1.0)  # a snapshot: the live tensor moving on leaves it alone
    assert not torch.equal(unpacked[0][1], weights[0][1])
    buckets[0].zero_()  # views of the buckets, not copies
    assert not unpacked[0][1].any()


def test_a_sender_broadcasts_to_every_receiver_and_remakes_the_group_when_its_members_change() -> None:
    weights = _weights()
    sender = Endpoint()
    address = sender.address()
    layout, buckets = pack(weights, torch.device("cpu"), bucket_bytes=64)
    receivers = [Endpoint() for _ in range(3)]
    for name, members in (("first", receivers), ("after a replica left", receivers[:2])):
        group = SyncGroup(address, name.replace(" ", "-"), len(members) + 1)
        got: dict[int, object] = {}

        def receive(rank: int, endpoint: Endpoint, group: SyncGroup = group, got: dict = got) -> None:
            got[rank] = endpoint.receive(group, rank, layout, bucket_bytes=64)

        threads = [threading.Thread(target=receive, args=(rank, endpoint))
                   for rank, endpoint in enumerate(members, start=1)]
        for thread in threads:
            thread.start()
        sender.send(group, buckets)
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(got) == list(range(1, len(members) + 1)), name
        assert all(_same(received, weights) for received in got.values()), name


def test_broadcast_sync_with_swapped_trainers_is_refused_naming_both_settings() -> None:
    config = {"run": "r", "environment": {"name": "arithmetic_check"},
              "agents": {"solver": {"model": "builtin:tiny"}, "verifier": {"model": "builtin:tiny"}},
              "ray": {"weight_sync": "broadcast", "resident_trainers": 1}}
    with pytest.raises(ConfigError, match=r"ray\.weight_sync: broadcast.*resident_trainers: 1 swaps 2 agents"):
        parse_config(config)
    config["ray"]["resident_trainers"] = 2
    assert parse_config(config).ray.weight_sync == "broadcast"
