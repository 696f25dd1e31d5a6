"""Multi-range ShardSpec and the fused/head layout arithmetic (section_layout, SectionLayout)."""

import random

import pytest
import torch

from tplayers.layers._sections import SectionLayout
from tplayers.sharding import ShardSpec, section_layout, shard_sizes


def test_multi_range_spec_take_and_shapes():
    full = torch.arange(24.0).reshape(12, 2)
    spec = ShardSpec.from_ranges((12, 2), 0, [(0, 2), (5, 5), (8, 11)], parts=3, index=1)
    assert spec.spans == ((0, 2), (8, 11)) and spec.local_offsets == (0, 2) and spec.local_shape == (5, 2)
    assert torch.equal(spec.take(full), torch.cat([full[0:2], full[8:11]]))
    one = ShardSpec.from_ranges((12, 2), 0, [(3, 6)], parts=2, index=0)
    assert one == ShardSpec(global_shape=(12, 2), dim=0, start=3, stop=6, parts=2, index=0)  # the single-range form
    none = ShardSpec.from_ranges((12, 2), 0, [(4, 4)], parts=2, index=1)
    assert none.spans == () and none.local_shape == (0, 2)
    with pytest.raises(ValueError, match="outside dim 0 of length 12"):
        ShardSpec.from_ranges((12, 2), 0, [(10, 13)], parts=2, index=0)


def test_section_layout_random_properties():
    rng = random.Random(0)
    for _ in range(300):
        parts = rng.randint(1, 6)
        hd = rng.choice([None, 1, 2])
        nblocks = rng.randint(1, 3)
        sections = [rng.randint(1, 7) * (hd or 1) for _ in range(nblocks)]
        table = section_layout(sections, parts, hd)
        offs = [sum(sections[:j]) for j in range(nblocks)]
        most = max(sections)
        for j, n in enumerate(sections):
            held = [table[r][j] for r in range(parts)]
            covered = set()
            for a, b in held:
                assert offs[j] <= a <= b <= offs[j] + n
                if hd:
                    assert (a - offs[j]) % hd == 0 and (b - a) % hd == 0  # whole heads
                covered |= set(range(a, b))
            assert covered == set(range(offs[j], offs[j] + n))  # every feature held
            heads = n // (hd or 1)
            kv = hd is not None and heads < parts and (nblocks == 1 or n < most)
            if kv:  # replicated in groups: rank r holds head r * heads // parts
                assert held == [
                    (offs[j] + (r * heads // parts) * hd, offs[j] + (r * heads // parts + 1) * hd) for r in range(parts)
                ]
            else:  # balanced, disjoint
                sizes = shard_sizes(heads, parts)
                assert [(b - a) // (hd or 1) for a, b in held] == sizes


def test_section_layout_replica_slots_and_gather_index():
    lay = SectionLayout.build("L", (8, 2, 2), parts=4, head_dim=1)
    assert lay.replicated == (False, True, True)
    assert lay.replica_slots(3) == (((2, 1, 1), (3, 1, 3)), 4)  # local rows 2 and 3 -> kv buffer rows 1 and 3
    order = lay.gather_index()  # rank-order concatenation: r0 [q0 q1 k0 v0] r1 [q2 q3 k0 v0] ...
    assert order == [0, 1, 4, 5, 8, 9, 12, 13, 2, 10, 3, 11]  # kv 1 first held by rank 2 (base 8)


def test_gqa_check_names_heads_and_ranks():
    with pytest.raises(ValueError, match=r"rank 1 holds query heads \[3, 6\) of block 0 \(8 heads\)"):
        SectionLayout.build("ColumnParallelLinear", (8, 2, 2), parts=3, head_dim=1)
    SectionLayout.build("L", (8, 1, 1), parts=3, head_dim=1)  # MQA splits at any rank count
