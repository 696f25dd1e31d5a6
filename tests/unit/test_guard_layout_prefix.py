"""The prefix layout (``tplayers.domain.layout``): ``k`` prefix tokens (a ViT's CLS token) before tokens
sharded along the flattened pixels, on one process. Views move a prefixed dim as a whole (split and
merge the other dims around it); anything merging or splitting the prefixed dim is a ``LayoutError``;
the prefix never counts as a mesh dim."""

import pytest

from tplayers.domain.layout import (
    PREFIX,
    LayoutError,
    add_prefix,
    broadcast_layouts,
    canonical_layout,
    drop_prefix,
    flatten_layout,
    mesh_dims_of,
    prefix_of,
    reshape_layout,
    sharded_dims,
    unflatten_layout,
)

TOKENS = ((3, 0), (5, None))  # 3 local patch rows of 5 columns, flattened
PREFIXED = add_prefix(TOKENS, 1)
LAY = (None, PREFIXED, None)  # (B, 1 + 15, D) on the first rank


def test_prefix_entries_are_read_and_built():
    assert PREFIXED == ((1, PREFIX), (3, 0), (5, None))
    assert prefix_of(PREFIXED) == 1 and prefix_of(TOKENS) == 0 and prefix_of(None) == 0
    assert drop_prefix(PREFIXED) == TOKENS
    assert mesh_dims_of(LAY) == (0,) and sharded_dims(LAY) == (1,)
    assert canonical_layout(LAY) == LAY
    with pytest.raises(LayoutError):
        add_prefix(PREFIXED, 1)  # one prefix per entry
    with pytest.raises(LayoutError):
        add_prefix(((4, None),), 1)  # before a whole entry: nothing sharded


def test_views_move_the_prefixed_dim_as_a_whole():
    shape = (2, 16, 8)  # the first rank: 1 + 15 tokens
    heads = reshape_layout(shape, LAY, (2, 16, 2, 4))  # x.view(B, T, heads, head_dim)
    assert heads == (None, PREFIXED, None, None)
    assert reshape_layout(shape, LAY, (2, -1, 8)) == LAY  # view(B, -1, D)
    assert flatten_layout((2, 16, 2, 4), heads, 2, 3) == LAY  # merging the head dims only


def test_views_merging_or_splitting_the_prefixed_dim_are_refused():
    with pytest.raises(LayoutError, match="prefix"):
        reshape_layout((2, 16, 8), LAY, (32, 8))  # batch and tokens merged
    with pytest.raises(LayoutError, match="prefix"):
        flatten_layout((2, 16, 8), LAY, 0, 1)
    with pytest.raises(LayoutError, match="prefix"):  # (B, heads, T, head_dim) -> (B, heads, T * head_dim)
        reshape_layout((2, 2, 16, 4), (None, None, PREFIXED, None), (2, 2, 64))
    with pytest.raises(LayoutError):
        unflatten_layout((2, 16, 8), LAY, 1, (4, 4))  # tokens split into a grid: the prefix has no place


def test_pointwise_ops_pair_equal_prefix_layouts_only():
    assert broadcast_layouts([(2, 16, 8), (1, 16, 8)], [LAY, (None, PREFIXED, None)]) == LAY
    with pytest.raises(LayoutError, match="sharded differently"):
        broadcast_layouts([(2, 16, 8), (2, 15, 8)], [LAY, (None, TOKENS, None)])
    with pytest.raises(LayoutError, match="replicated operand"):
        broadcast_layouts([(2, 16, 8), (1, 26, 8)], [LAY, None])  # a full-size position table, unsliced
