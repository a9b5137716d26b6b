"""The packed 2:4 format: exact round trip, CUTLASS's layout, checkpoint size, clear errors."""

import pytest
import torch
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import nmcompile
import reference
from nmcompile.kernels.format24 import META_SUFFIX


def pruned(shape, dtype=torch.float32):
    w = torch.randn(shape)
    return (w * reference.topn_mask(w, 2, 4, -1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16,), (8, 32), (2, 3, 48)])
def test_round_trip_is_exact(dtype, shape):
    w = pruned(shape, dtype)
    w.view(-1)[:8] = 0  # groups with fewer than two non-zeros
    packed = nmcompile.pack(w)
    assert packed.values.shape == (*shape[:-1], shape[-1] // 2) and packed.values.dtype == dtype
    assert packed.meta.shape == (*shape[:-1], shape[-1] // 16) and packed.meta.dtype == torch.int16
    assert packed.shape == w.shape
    assert torch.equal(nmcompile.unpack(packed), w)


def test_metadata_encodes_the_kept_positions_by_hand():
    w = torch.zeros(1, 16)
    w[0, [0, 1]] = 1.0  # group 0 keeps 0,1 -> nibble 0b0100
    w[0, [4, 6]] = 2.0  # group 1 keeps 0,2 -> 0b1000
    w[0, [9, 10]] = 3.0  # group 2 keeps 1,2 -> 0b1001
    w[0, [14, 15]] = 4.0  # group 3 keeps 2,3 -> 0b1110
    packed = nmcompile.pack(w)
    assert packed.values.tolist() == [[1, 1, 2, 2, 3, 3, 4, 4]]
    word = 0b0100 | 0b1000 << 4 | 0b1001 << 8 | 0b1110 << 12
    assert packed.meta.item() == word - (1 << 16)  # stored as signed int16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cutlass_layout_is_what_torch_s_2_4_kernels_take(dtype):
    w = pruned((64, 128), dtype)
    values, meta = sparse_semi_structured_from_dense_cutlass(w)
    ours_values, ours_meta = nmcompile.pack(w).cutlass()
    assert torch.equal(ours_values, values) and torch.equal(ours_meta, meta)


def test_checkpoint_with_packed_weights_takes_56_percent_of_the_bytes(tmp_path):
    torch.manual_seed(0)
    state = {f"layer{i}.weight": pruned((256, 512), torch.float16) for i in range(4)}
    state["layer0.bias"] = torch.randn(256, dtype=torch.float16)
    dense_path, packed_path = tmp_path / "dense.pt", tmp_path / "packed.pt"
    torch.save(state, dense_path)
    packed = nmcompile.deploy.pack_state_dict(state)
    assert set(packed) == set(state) | {f"layer{i}.weight{META_SUFFIX}" for i in range(4)}
    torch.save(packed, packed_path)
    ratio = packed_path.stat().st_size / dense_path.stat().st_size
    assert 0.55 < ratio < 0.58, ratio  # 9/16 of the weight bytes, plus the dense bias and file overhead
    restored = nmcompile.deploy.unpack_state_dict(torch.load(packed_path, weights_only=True))
    assert restored.keys() == state.keys() and all(torch.equal(restored[k], state[k]) for k in state)
    assert nmcompile.check(packed_path).ok  # the checker unpacks


def test_named_packing_never_reads_the_tensors_it_leaves_dense():
    # a model's embedding (128k words) is not named: counting its groups once took 3 GB while saving
    state = {"proj.weight": pruned((64, 32)), "embed.weight": torch.empty(1 << 20, 64, device="meta")}
    packed = nmcompile.deploy.pack_state_dict(state, names=["proj.weight"])
    assert packed["embed.weight"] is state["embed.weight"] and f"proj.weight{META_SUFFIX}" in packed
    with pytest.raises(RuntimeError, match="meta"):  # what reading it would have done
        nmcompile.deploy.pack_state_dict(state)


def test_bad_input_gets_errors_that_say_how_to_fix_it():
    with pytest.raises(ValueError, match="more than 2 non-zeros.*nmcompile.finalize"):
        nmcompile.pack(torch.randn(4, 16))
    with pytest.raises(ValueError, match="multiple of 16.*pad"):
        nmcompile.pack(torch.zeros(4, 12))
    with pytest.raises(ValueError, match="do not belong together"):
        nmcompile.unpack(nmcompile.deploy.Packed24(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int16)))
    with pytest.raises(ValueError, match="cannot be packed"):
        nmcompile.deploy.pack_state_dict({"w": torch.randn(4, 16)}, names={"w"})
    with pytest.raises(ValueError, match="names 'nope.weight' are not in the state dict.*its >= 2-D tensors: w"):
        nmcompile.deploy.pack_state_dict({"w": pruned((4, 16))}, names=["w", "nope.weight"])
    with pytest.raises(ValueError, match="rows divisible by 32"):
        nmcompile.pack(pruned((16, 32), torch.float16)).cutlass()


def _packed_with_zero_groups():
    torch.manual_seed(0)
    w = pruned((32, 64), torch.float16)
    w[:, :8] = 0  # all-zero groups
    w[3, 16:20] = torch.tensor([0.0, 0.0, 5.0, 0.0])  # one non-zero
    return w


def test_unpack_refuses_metadata_that_is_not_nmcompile_s_layout():
    w = _packed_with_zero_groups()
    packed = nmcompile.pack(w)
    assert torch.equal(nmcompile.unpack(packed), w)
    not_ours = {
        "torch's CUTLASS conversion": sparse_semi_structured_from_dense_cutlass(w),
        "Packed24.cutlass order": packed.cutlass(),
    }
    equal_indices = packed.meta.clone()
    equal_indices[0, 0] = 0  # four groups coded (0, 0)
    not_ours["two equal indices"] = (packed.values, equal_indices)
    reversed_pair = packed.meta.clone()
    reversed_pair[5, 1] = (reversed_pair[5, 1] & ~0xF) | (1 | 0 << 2)  # (i0, i1) = (1, 0)
    not_ours["i0 > i1"] = (packed.values, reversed_pair)
    for what, (values, meta) in not_ours.items():
        try:
            nmcompile.unpack(nmcompile.deploy.Packed24(values, meta))
        except ValueError as err:
            assert "not nmcompile's packed layout" in str(err), what
        else:
            pytest.fail(f"unpack accepted metadata with {what}")
    with pytest.raises(ValueError, match="not nmcompile's packed layout"):
        nmcompile.deploy.unpack_state_dict({"w": packed.values, "w" + META_SUFFIX: equal_indices})


def test_weights_2_4_along_dim_0_are_packed_as_their_transpose():
    torch.manual_seed(0)
    conv1d = pruned((32, 48)).t().contiguous()  # [in, out] = [48, 32], 2:4 along dim 0
    state = {"c.weight": conv1d, "fc.weight": pruned((8, 32))}
    packed = nmcompile.deploy.pack_state_dict(state, dims={"c.weight": 0})
    assert packed["c.weight"].shape == (32, 24) and packed["fc.weight"].shape == (8, 16)
    assert packed._metadata["nmcompile.nm24"] == {"packed": ["c.weight", "fc.weight"], "transposed": ["c.weight"]}
    restored = nmcompile.deploy.unpack_state_dict(packed)
    assert all(torch.equal(restored[k], state[k]) for k in state) and restored["c.weight"].is_contiguous()
    assert nmcompile.check(packed).ok and nmcompile.check(packed)["c.weight"].dim == 0
    with pytest.raises(ValueError, match=r"'fc.weight' \(8, 32\) cannot be packed as 2:4 along dim 0"):
        nmcompile.deploy.pack_state_dict(state, dims={"fc.weight": 0})
    with pytest.raises(ValueError, match="names 'x' are not in the state dict"):
        nmcompile.deploy.pack_state_dict(state, dims={"x": 0})
