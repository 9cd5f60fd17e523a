"""W4A16 against compressed-tensors: quantization, packing, and a whole pack-quantized model."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edgemtp.errors import EdgeMTPError
from edgemtp.quantize.w4a16 import (
    W4A16Scheme,
    dequantize_w4a16,
    pack_int4,
    parse_quantization_config,
    quantize_w4a16,
    read_pack_quantized,
    to_pack_quantized,
    unpack_int4,
)

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized import (  # noqa: E402
    PackedQuantizationCompressor,
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402


def _args(group: int, symmetric: bool, scale_dtype: torch.dtype | None = None):
    return QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy="group",
        group_size=group,
        scale_dtype=scale_dtype,
    )


def _weight(out: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows of varied magnitude, plus an all-zero row, a one-signed row and exact ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * torch.logspace(-3, 0, out).unsqueeze(1)
    if out >= 4:
        w[0] = 0
        w[1] = w[1].abs() + 0.01
        w[2] = torch.arange(cols).remainder(31).sub(15) * 0.25  # x / scale hits k + 0.5
    return w.to(dtype)


def _check_against_ct(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype):
    args = _args(group, symmetric, scale_dtype)
    scale, zp = compute_dynamic_scales_and_zp(value=w, args=args, module=None)
    ct_codes = quantize(w, scale, zp, args, dtype=torch.int8)
    ct_fake = fake_quantize(w, scale, zp, args)

    q = quantize_w4a16(w, group, symmetric, scale_dtype)
    assert q.scales.dtype == scale_dtype and torch.equal(q.scales, scale.to(scale_dtype))
    if symmetric:
        assert q.zero_points is None
        assert torch.equal(q.codes, ct_codes)
    else:
        assert torch.equal(q.zero_points, zp + 8)
        assert torch.equal(q.codes, ct_codes + 8)
    assert int(q.codes.min()) >= (-8 if symmetric else 0)
    assert int(q.codes.max()) <= (7 if symmetric else 15)
    assert torch.equal(dequantize_w4a16(q).to(ct_fake.dtype), ct_fake)

    # the same layer through compressed-tensors' pack-quantized compressor, and back through ours
    layer = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    packed = PackedQuantizationCompressor.compress(
        layer, QuantizationScheme(targets=["Linear"], weights=args)
    )
    ours = to_pack_quantized(q)
    assert ours.keys() == packed.keys()
    for key, tensor in ours.items():
        assert torch.equal(tensor, packed[key].to(tensor.dtype)), key
    back = read_pack_quantized(packed, W4A16Scheme(group, symmetric))
    assert torch.equal(dequantize_w4a16(back).to(ct_fake.dtype), ct_fake)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "w_dtype,scale_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_matches_compressed_tensors(group, symmetric, w_dtype, scale_dtype):
    _check_against_ct(_weight(16, 256, w_dtype), group, symmetric, scale_dtype)


@settings(max_examples=25, deadline=None)
@given(
    out=st.integers(1, 9),
    groups=st.integers(1, 4),
    group=st.sampled_from([8, 32, 64, 128]),
    symmetric=st.booleans(),
    w_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_compressed_tensors(out, groups, group, symmetric, w_dtype, seed):
    w = _weight(out, groups * group, w_dtype, seed)
    _check_against_ct(w, group, symmetric, torch.bfloat16)


def test_symmetric_range_is_absmax_over_7_5():
    # The scale maps |max| to 7.5: the negative extreme rounds (half to even) to -8, a positive
    # extreme clips to 7.
    w = torch.tensor([[-3.0, 0.0, 1.0, 2.0], [3.0, 0.0, -1.0, -2.0]])
    q = quantize_w4a16(w, group_size=4, scale_dtype=torch.float32)
    assert torch.equal(q.scales, torch.tensor([[0.4], [0.4]]))
    assert q.codes.tolist() == [[-8, 0, 2, 5], [7, 0, -2, -5]]


@pytest.mark.parametrize("cols", [1, 8, 12, 32, 37, 64, 256])
def test_pack_matches_compressed_tensors_bit_for_bit(cols):
    codes = torch.randint(-8, 8, (5, cols), dtype=torch.int8, generator=torch.Generator())
    codes[0, : min(cols, 16)] = torch.arange(-8, 8, dtype=torch.int8)[: min(cols, 16)]
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4(packed, codes.shape), codes)
    assert torch.equal(unpack_from_int32(packed, 4, codes.shape), codes)
    # zero points are packed along the output dimension
    assert torch.equal(pack_int4(codes.T).T, pack_to_int32(codes, 4, packed_dim=0))


def test_pack_nibble_order():
    codes = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)  # nibbles 0..15
    assert pack_int4(codes).view(torch.uint32).tolist() == [[0x76543210, 0xFEDCBA98]]


# --- a whole model through compressed-tensors ------------------------------------------------


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 128, bias=False)
        self.down_proj = nn.Linear(128, 60, bias=False)  # zero points pad along out


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.lm_head = nn.Linear(64, 10, bias=False)


def _compress_with_ct() -> tuple[_Tiny, dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """compressed-tensors' own path: attach schemes, calibrate min-max (what llm-compressor's
    observer does), compress to pack-quantized. Returns the original weights too."""
    torch.manual_seed(0)
    model = _Tiny().to(torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    config = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=_args(32, True)),
            "group_1": QuantizationScheme(targets=["re:.*down_proj$"], weights=_args(64, False)),
        },
        ignore=["lm_head", "re:layers\\.1\\.q_"],
        format="pack-quantized",
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            scale, zp = compute_dynamic_scales_and_zp(module.weight, scheme.weights, module)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    qconfig = json.loads(json.dumps(compressor.quantization_config.model_dump()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, {"quantization_config": qconfig}, state, original


def test_reads_compressed_tensors_checkpoint():
    model, config, state, original = _compress_with_ct()
    cfg = parse_quantization_config(config)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    quantized = set()
    for name in linears:
        module = model.get_submodule(name)
        ct_scheme = getattr(module, "quantization_scheme", None)
        scheme = cfg.scheme_for(name)
        assert (scheme is None) == (ct_scheme is None), name
        if scheme is None:
            assert torch.equal(state[f"{name}.weight"], original[f"{name}.weight"])
            continue
        quantized.add(name)
        assert scheme.group_size == ct_scheme.weights.group_size
        assert scheme.symmetric == ct_scheme.weights.symmetric
        local = {k.removeprefix(f"{name}."): v for k, v in state.items() if k.startswith(name)}
        assert ("weight_zero_point" in local) == (not scheme.symmetric)
        q = read_pack_quantized(local, scheme, name)

        # compressed-tensors' own decompression of the same tensors
        ct_weight = PackedQuantizationCompressor.decompress(local, ct_scheme)["weight"]
        assert torch.equal(dequantize_w4a16(q).to(ct_weight.dtype), ct_weight), name

        # and our quantizer writes the very same checkpoint tensors
        ours = quantize_w4a16(
            original[f"{name}.weight"], scheme.group_size, scheme.symmetric, torch.bfloat16
        )
        for key, tensor in to_pack_quantized(ours).items():
            assert torch.equal(tensor, local[key]), (name, key)
        assert torch.equal(ours.codes, q.codes) and torch.equal(ours.scales, q.scales)
    assert quantized == {
        "layers.0.q_proj",
        "layers.0.down_proj",
        "layers.1.down_proj",
    }
    assert cfg.scheme_for("layers.0.down_proj").group_size == 64  # regex beats class


def test_read_with_raw_scheme_dict_and_inferred_shape():
    w = _weight(8, 128, torch.float32)
    q = quantize_w4a16(w, 32, symmetric=False)
    tensors = to_pack_quantized(q)
    del tensors["weight_shape"]
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32}}
    scheme["weights"]["symmetric"] = False
    back = read_pack_quantized(tensors, scheme)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zero_points, q.zero_points)
    assert back.shape == (8, 128)


# --- quantization_config matching ------------------------------------------------------------


def _group(group_size: int = 128, symmetric: bool = True, targets=("Linear",), **extra) -> dict:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    } | extra
    return {"targets": list(targets), "weights": weights, "input_activations": None}


def _config(groups: dict, ignore=(), **extra) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "quantization_status": "compressed",
    } | extra


def test_ignore_and_precedence():
    cfg = parse_quantization_config(
        _config(
            {
                "a": _group(128),
                "b": _group(32, targets=["re:.*mlp\\..*"]),
                "c": _group(64, targets=["model.layers.0.mlp.down_proj"]),
            },
            ignore=["lm_head", "re:.*vision.*", "re:encoder\\.", "Embedding"],
        )
    )
    assert cfg.scheme_for("model.layers.3.self_attn.q_proj").group_size == 128
    assert cfg.scheme_for("model.layers.3.mlp.up_proj").group_size == 32
    assert cfg.scheme_for("model.layers.0.mlp.down_proj").group_size == 64
    assert cfg.scheme_for("lm_head") is None
    assert cfg.scheme_for("model.vision_tower.proj") is None
    assert cfg.scheme_for("model.embed_tokens", class_names=("Embedding", "Module")) is None
    assert cfg.scheme_for("model.norm", class_names=("RMSNorm",)) is None
    # re: patterns match from the start of the name, like re.match
    assert cfg.scheme_for("encoder.proj") is None
    assert cfg.scheme_for("model.encoder.proj").group_size == 128


def test_preset_groups_and_plain_config_dict():
    cfg = parse_quantization_config({"config_groups": {"W4A16_ASYM": ["Linear"]}})
    assert cfg.scheme_for("x") == W4A16Scheme(128, False, ("Linear",))


@pytest.mark.parametrize(
    "config,needle",
    [
        (_config({"g": _group(num_bits=8)}), "num_bits=8"),
        (_config({"g": _group(type="float")}), "type='float'"),
        (_config({"g": _group(strategy="channel", group_size=None)}), "strategy='channel'"),
        (_config({"g": _group(actorder="group")}), "actorder"),
        (_config({"g": _group()}, format="naive-quantized"), "naive-quantized"),
        (_config({"g": _group()}, quant_method="gptq"), "gptq"),
        (_config({"g": _group()}, kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (_config({"g": _group() | {"input_activations": {"num_bits": 8}}}), "input_activations"),
        (_config({"W8A8": ["Linear"]}), "W8A8"),
        (_config({}), "config_groups"),
    ],
)
def test_unsupported_configs(config, needle):
    with pytest.raises(EdgeMTPError) as err:
        parse_quantization_config(config)
    assert needle in str(err.value) and "\n" not in str(err.value)


# --- errors ----------------------------------------------------------------------------------


def test_quantize_errors_name_the_tensor():
    with pytest.raises(EdgeMTPError, match="blk.0.w.*100 input features.*group size 128"):
        quantize_w4a16(torch.zeros(4, 100), 128, name="blk.0.w")
    bad = torch.zeros(4, 64)
    bad[1, 3] = float("nan")
    bad[2, 5] = float("inf")
    with pytest.raises(EdgeMTPError, match="blk.1.w has 2 NaN/inf"):
        quantize_w4a16(bad, 32, name="blk.1.w")
    with pytest.raises(EdgeMTPError, match="2-D"):
        quantize_w4a16(torch.zeros(64), 32)
    with pytest.raises(EdgeMTPError, match="scale dtype"):
        quantize_w4a16(torch.zeros(2, 64), 32, scale_dtype=torch.float8_e4m3fn)
    with pytest.raises(EdgeMTPError, match="-8..7"):
        pack_int4(torch.full((1, 8), 9, dtype=torch.int8))


def test_read_errors():
    q = quantize_w4a16(_weight(8, 128, torch.float32), 32, symmetric=False)
    tensors = to_pack_quantized(q)
    asym, sym = W4A16Scheme(32, False), W4A16Scheme(32, True)
    with pytest.raises(EdgeMTPError, match="lacks weight_zero_point"):
        read_pack_quantized({k: v for k, v in tensors.items() if "zero" not in k}, asym)
    with pytest.raises(EdgeMTPError, match="nonzero weight_zero_point"):
        read_pack_quantized(tensors, sym)
    with pytest.raises(EdgeMTPError, match="group_size 64"):
        read_pack_quantized(tensors, W4A16Scheme(64, False), "model.x")
    with pytest.raises(EdgeMTPError, match="lacks weight_packed"):
        read_pack_quantized({"weight_scale": q.scales}, asym)
