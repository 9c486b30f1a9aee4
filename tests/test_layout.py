"""ShardLayout arithmetic, checked against a direct construction of the padded matrix."""
import pytest
import torch

from etp import ShardLayout


def _expected_shards(full: torch.Tensor, world: int, align: int) -> list[torch.Tensor]:
    # Independent reference: build the padded matrix explicitly and chunk it.
    rows = full.numel() // full.shape[-1]
    unit = align * world
    padded_rows = max(unit, ((rows + unit - 1) // unit) * unit)
    padded = torch.zeros(padded_rows, full.shape[-1], dtype=full.dtype)
    padded[:rows] = full.reshape(rows, -1)
    return list(padded.chunk(world))


@pytest.mark.parametrize(
    "shape,world,align",
    [((40, 24), 4, 1), ((40, 24), 4, 16), ((1, 8), 4, 16), ((3, 5), 4, 1), ((3, 7, 5), 2, 2),
     ((16, 6, 4), 4, 4), ((5, 3), 1, 16)],
)
def test_shards_tile_the_padded_weight(shape, world, align):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = _expected_shards(full, world, align)
    layouts = [ShardLayout(shape, world, r, align) for r in range(world)]
    for layout, want in zip(layouts, expected):
        got = layout.shard_of(full)
        assert got.shape == want.shape == layout.shard_shape
        assert torch.equal(got, want)
        assert layout.shard_rows % align == 0
        assert torch.count_nonzero(got[layout.valid_rows:]) == 0
    assert sum(lay.valid_rows for lay in layouts) == full.numel() // shape[-1]
    gathered = torch.cat([lay.shard_of(full) for lay in layouts])
    assert torch.equal(layouts[0].unpad(gathered), full)


def test_padding_spills_over_several_ranks():
    layouts = [ShardLayout((1, 8), 4, r, 16) for r in range(4)]
    assert [lay.valid_rows for lay in layouts] == [1, 0, 0, 0]
    assert [lay.padding_rows for lay in layouts] == [15, 16, 16, 16]


@pytest.mark.parametrize("bad", [dict(logical_shape=(8,)), dict(rank=4), dict(align=0)])
def test_invalid_layouts(bad):
    kwargs = dict(logical_shape=(8, 4), world=4, rank=0, align=1) | bad
    with pytest.raises(ValueError):
        ShardLayout(**kwargs)
