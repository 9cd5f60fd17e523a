"""Tests for edgemtp.quantize.q4_0 against gguf-py's reference Q4_0 (the test-only oracle)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgemtp.errors import EdgeMTPError
from edgemtp.quantize.q4_0 import (
    Q4_0,
    dequantize_q4_0,
    pack_q4_0,
    quantize_q4_0,
    unpack_q4_0,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


def ref_bytes(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # the reference warns on its own edge cases
        return gguf.quants.quantize(x, GGMLQuantizationType.Q4_0)


def ref_floats(raw: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_0)


def bits(a: torch.Tensor | np.ndarray) -> np.ndarray:
    """float32 bit patterns, so that -0.0 and 0.0 (and NaN payloads) count as different."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.int32)


def assert_matches_reference(x: np.ndarray) -> Q4_0:
    q = quantize_q4_0(x)
    ref = ref_bytes(x)
    raw = pack_q4_0(q)
    assert raw.dtype == np.uint8 and raw.shape == ref.shape
    np.testing.assert_array_equal(raw, ref)
    np.testing.assert_array_equal(bits(dequantize_q4_0(q)), bits(ref_floats(ref)))
    return q


# --- bit-exact against the reference ------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (17, 96), (64, 256), (5, 4096), (256,)])
@pytest.mark.parametrize("scale", [1e-4, 0.02, 1.0, 300.0])
def test_random_matrices_match_reference(shape: tuple[int, ...], scale: float) -> None:
    rng = np.random.default_rng(hash((shape, scale)) % 2**32)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    q = assert_matches_reference(x)
    assert q.shape == shape and tuple(dequantize_q4_0(q).shape) == shape


def test_heavy_tailed_and_offset_data_match_reference() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_t(2, (40, 512)) + 0.3).astype(np.float32)
    assert_matches_reference(x)
    assert_matches_reference(rng.uniform(-1, 1, (8, 256)).astype(np.float32) ** 5)


def _blocks(*rows: list[float]) -> np.ndarray:
    """One row per block: each row is padded with a small ramp so its extreme stays as given."""
    out = np.tile(np.linspace(-0.01, 0.01, 32, dtype=np.float32), (len(rows), 1))
    for i, vals in enumerate(rows):
        out[i, : len(vals)] = vals
    return out


def test_special_blocks_match_reference() -> None:
    x = _blocks([1.0], [-1.0], [0.5, -0.5], [-0.5, 0.5], [0.1, -0.2, 0.2, 0.2], [3.0] * 32)
    zeros = np.zeros((1, 32), np.float32)
    neg_zeros = np.full((1, 32), -0.0, np.float32)
    x = np.concatenate([x, zeros, neg_zeros])
    q = assert_matches_reference(x)

    scales = q.scales[:, 0].float()
    assert scales[0] < 0 and scales[1] > 0  # d = m / -8: the sign opposite to m's
    assert scales[2] < 0 and scales[3] > 0  # +-0.5 tie: the first one wins
    assert scales[4] > 0  # -0.2, 0.2, 0.2: the first (-0.2) wins
    assert (q.codes[5] == 0).all()  # a constant block sits at code 0 (x * id = -8)
    # an all-zero block stores d = 0 / -8 = -0.0; an all-(-0.0) block stores +0.0
    assert pack_q4_0(q)[6, :2].tolist() == [0x00, 0x80]
    assert pack_q4_0(q)[7, :2].tolist() == [0x00, 0x00]
    assert (q.codes[6:] == 8).all()


@pytest.mark.parametrize(
    "peak",
    [1e-45, 1e-40, 2e-38, 1e-30, 1e-9, 3e-7, 5e-6, 1e-4, 6.1e-5 * 8, 1e4, 524159.0],
    ids=lambda p: f"{p:g}",
)
def test_tiny_and_huge_blocks_match_reference(peak: float) -> None:
    """fp16 scale underflow (to subnormal or zero) and the largest peak that still fits in fp16."""
    rng = np.random.default_rng(2)
    x = (rng.uniform(-1, 1, (4, 64)) * peak).astype(np.float32)
    x[:, 5] = np.float32(peak)
    x[1, 7] = -np.float32(peak)  # a tie with the opposite sign after the peak
    x[2, 40] = -np.float32(peak)
    assert_matches_reference(x)


def test_subnormal_blocks_whose_inverse_scale_overflows() -> None:
    """|d| < ~2.9e-39 makes 1/d inf: the reference (on x86) writes code 0; d == 0 gives code 8."""
    x = np.zeros((2, 32), np.float32)
    x[0, :3] = [1e-39, -5e-40, 1e-45]
    x[1, 0] = -1e-45
    q = assert_matches_reference(x)
    assert (q.codes[0] == 0).all()  # 1e-39 / -8 is a subnormal whose inverse overflows
    assert (q.codes[1] == 8).all()  # -1e-45 / -8 underflows to 0.0
    assert (dequantize_q4_0(q) == 0).all()


def test_scale_overflowing_fp16_raises_where_the_reference_stores_inf() -> None:
    x = np.full((1, 32), 0.5, np.float32)
    x[0, 3] = 524160.0
    assert ref_bytes(x)[0, :2].tolist() == [0x00, 0xFC]  # fp16 -inf: dequantizes to inf/NaN
    with pytest.raises(EdgeMTPError, match=r"^wq: .*overflows the Q4_0 fp16 scale"):
        quantize_q4_0(x, name="wq")


finite = st.floats(-6e4, 6e4, width=32, allow_nan=False, allow_infinity=False)
tie_prone = st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.25, -0.25, 7.0, -7.0, 1e-3, -1e-3])


@SETTINGS
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda n: 32 * n)),
        elements=st.one_of(finite, tie_prone),
    )
)
def test_hypothesis_matches_reference(x: np.ndarray) -> None:
    assert_matches_reference(x)


@SETTINGS
@given(
    hnp.arrays(np.float32, (2, 64), elements=st.floats(-1, 1, width=32)),
    st.sampled_from([1e-30, 1e-6, 1e-2, 1.0, 1e3, 5e5]),
)
def test_hypothesis_scaled_matches_reference(x: np.ndarray, scale: float) -> None:
    assert_matches_reference((x * np.float32(scale)).astype(np.float32))


def test_torch_inputs_quantize_like_float32_numpy() -> None:
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    ref = ref_bytes(w.numpy())
    np.testing.assert_array_equal(pack_q4_0(quantize_q4_0(w)), ref)
    np.testing.assert_array_equal(pack_q4_0(quantize_q4_0(w.double().numpy())), ref)
    for dtype in (torch.bfloat16, torch.float16):
        wd = w.to(dtype).requires_grad_(False)
        np.testing.assert_array_equal(pack_q4_0(quantize_q4_0(wd)), ref_bytes(wd.float().numpy()))


# --- layout ---------------------------------------------------------------------------------------


def test_pack_layout_by_hand() -> None:
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    q = Q4_0(scales=torch.tensor([[0.5]], dtype=torch.float16), codes=codes, shape=(1, 32))
    raw = pack_q4_0(q)
    assert raw.shape == (1, 18)
    assert raw[0, :2].tolist() == [0x00, 0x38]  # fp16 0.5, little-endian
    assert raw[0, 2:].tolist() == [j | (j << 4) for j in range(16)]  # x[j] low, x[j + 16] high


def test_unpack_pack_round_trips_arbitrary_bytes() -> None:
    raw = np.random.default_rng(4).integers(0, 256, (6, 4 * 18), dtype=np.uint8)
    q = unpack_q4_0(raw, (6, 128))
    np.testing.assert_array_equal(pack_q4_0(q), raw)
    np.testing.assert_array_equal(pack_q4_0(unpack_q4_0(raw.tobytes(), (6, 128))), raw)
    finite_raw = ref_bytes(np.random.default_rng(5).standard_normal((6, 128)).astype(np.float32))
    np.testing.assert_array_equal(
        bits(dequantize_q4_0(unpack_q4_0(finite_raw, (6, 128)))), bits(ref_floats(finite_raw))
    )


def test_pack_unpack_round_trip_keeps_scales_and_codes() -> None:
    x = np.random.default_rng(6).standard_normal((9, 160)).astype(np.float32)
    q = quantize_q4_0(x)
    back = unpack_q4_0(pack_q4_0(q), x.shape)
    assert back.shape == q.shape
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.scales.view(torch.int16), q.scales.view(torch.int16))
    one_d = quantize_q4_0(x[0])
    assert pack_q4_0(one_d).shape == (5 * 18,)
    assert torch.equal(
        dequantize_q4_0(unpack_q4_0(pack_q4_0(one_d), (160,))),
        torch.tensor(ref_floats(ref_bytes(x[0]))),
    )


def test_gguf_file_round_trip(tmp_path) -> None:
    """Our bytes are the file format: gguf writes them, gguf reads them back, both dequantize."""
    x = np.random.default_rng(7).standard_normal((48, 256)).astype(np.float32) * 0.05
    q = quantize_q4_0(x, name="blk.0.attn_q.weight")
    path = tmp_path / "q4_0.gguf"
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_tensor("blk.0.attn_q.weight", pack_q4_0(q), raw_dtype=GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    (t,) = gguf.GGUFReader(path).tensors
    assert t.name == "blk.0.attn_q.weight"
    assert t.tensor_type == GGMLQuantizationType.Q4_0
    assert [int(s) for s in t.shape] == [256, 48]  # ggml order: ne0 (columns) first
    shape = tuple(int(s) for s in reversed(t.shape))
    np.testing.assert_array_equal(np.asarray(t.data), pack_q4_0(q))
    back = unpack_q4_0(t.data, shape)
    np.testing.assert_array_equal(bits(dequantize_q4_0(back)), bits(dequantize_q4_0(q)))
    np.testing.assert_array_equal(bits(dequantize_q4_0(back)), bits(ref_floats(t.data)))


# --- int4 group form ------------------------------------------------------------------------------


def test_int4_groups_dequantize_to_identical_floats() -> None:
    """The int4 form every backend lowers (`export.weights.int4_weight`): the same floats."""
    from edgemtp.export.weights import int4_weight

    x = np.random.default_rng(8).standard_normal((12, 192)).astype(np.float32)
    x[0, :32] = 0.0  # -0.0 scale: the zero products must keep the same sign in both forms
    q = quantize_q4_0(x)
    w4 = int4_weight(q)
    values, scales = w4.signed_codes(), w4.scales
    assert values.dtype == torch.int8 and tuple(values.shape) == (12, 192)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (12, 6)
    assert int(values.min()) >= -8 and int(values.max()) <= 7
    assert torch.equal(scales, q.scales.float())
    w = values.float() * scales.repeat_interleave(32, dim=1)
    np.testing.assert_array_equal(bits(w), bits(dequantize_q4_0(q)))
    np.testing.assert_array_equal(bits(w), bits(ref_floats(ref_bytes(x))))


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (np.zeros((4, 33), np.float32), "positive multiple of 32"),
        (np.zeros((4, 0), np.float32), "positive multiple of 32"),
        (np.zeros((2, 2, 32), np.float32), "1-D or 2-D"),
        (np.float32(1.0), "1-D or 2-D"),
        (np.array([[np.nan] + [0.0] * 31], np.float32), "1 NaN or inf"),
        (np.array([[np.inf, -np.inf] + [0.0] * 30], np.float32), "2 NaN or inf"),
    ],
)
def test_bad_tensors_raise_naming_the_tensor(x: np.ndarray, message: str) -> None:
    with pytest.raises(EdgeMTPError, match=rf"^blk\.3\.ffn_up\.weight: .*{message}") as err:
        quantize_q4_0(x, name="blk.3.ffn_up.weight")
    assert "\n" not in str(err.value)


def test_unpack_rejects_wrong_sizes_and_bad_q4_0() -> None:
    with pytest.raises(EdgeMTPError, match=r"^w: 36 bytes do not hold .*\(4, 32\)"):
        unpack_q4_0(bytes(36), (4, 32), name="w")
    with pytest.raises(EdgeMTPError, match="codes must lie in 0..15"):
        Q4_0(
            torch.zeros(1, 1, dtype=torch.float16),
            torch.full((1, 32), 16, dtype=torch.uint8),
            (1, 32),
        )
    with pytest.raises(EdgeMTPError, match="scales must be float16"):
        Q4_0(torch.zeros(1, 1), torch.zeros(1, 32, dtype=torch.uint8), (1, 32))
