"""Import Gemma 4 GGUF files as llama.cpp's converter writes them (architecture `gemma4`).

What llama.cpp's converter (`Gemma4Model(Gemma3Model)` in `convert_hf_to_gguf.py` /
`conversion/gemma.py`) does to a Hugging Face checkpoint, and how this module undoes it:

- Tensor names follow gguf-py's `TensorNameMap` (`blk.N.attn_q.weight` ...); `_GLOBAL` and
  `_BLOCK` below map them back. `layer_scalar` gets a `.weight` suffix on the way in
  (`blk.N.layer_output_scale.weight`, shape [1]); it is stripped again.
- Norm weights are stored as they are: Gemma 4's `norm_shift` is 0 (Gemma 3 adds 1). There is no
  Q/K permutation (NEOX RoPE) and nothing is split or merged in the dense models.
- `token_embd` loses the rows past the tokenizer's vocabulary: `vocab_size` is its row count.
- An extra `rope_freqs.weight` [global_head_dim / 2] holds 1.0 for the full layers' rotated
  angle pairs and 1e30 for the rest: it encodes proportional RoPE's `partial_rotary_factor`
  and goes into the config, not into the model.
- The HF config becomes `gemma4.*` key-values (see `GGUFSource._build_config`); per-layer values
  (sliding pattern, KV heads, double-wide MLP widths) are arrays.
- Shapes are stored in ggml order (reversed); they come back in PyTorch order.

llama.cpp's KV-shared layers reuse layer `first_shared - 2` (sliding) and `first_shared - 1`
(full); transformers reuses the last earlier layer of the same kind. Files where these differ are
refused, since the two would compute different models.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from edgemtp.errors import EdgeMTPError
from edgemtp.model.checkpoint import TensorSource
from edgemtp.model.config import TextConfig, parse_text_config
from edgemtp.model.gemma4 import Gemma4Target
from edgemtp.model.tables import Rows
from edgemtp.quantize.q4_0 import Q4_0, dequantize_q4_0, unpack_q4_0
from edgemtp.quantize.tables import BlockRows, Q4_0Rows

ARCH = "gemma4"
Q8_0_BLOCK = 32  # weights per block
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8 values
_T = GGMLQuantizationType
SUPPORTED = (_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q8_0)
_FIX_CONVERT = "re-convert the model with llama.cpp's convert_hf_to_gguf.py"
_FIX_TYPES = (
    "edgemtp reads F32, F16, BF16, Q4_0 and Q8_0 GGUF tensors (re-quantize with "
    "`llama-quantize --pure` to Q4_0 or Q8_0)"
)

# GGUF name -> Hugging Face name (gguf-py's TensorNameMap for MODEL_ARCH.GEMMA4, reversed).
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
_ROPE_FREQS = "rope_freqs.weight"
_BLK = re.compile(r"blk\.(\d+)\.(.+)")
_MOE_PARTS = ("_exps", "ffn_gate_inp", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")
_UNROTATED = 1e20  # rope_freqs factors at least this large leave their angle pair unrotated
_REQUIRED = object()


def dequantize_q8_0(
    raw: bytes | np.ndarray, shape: tuple[int, ...], name: str = "tensor"
) -> torch.Tensor:
    """GGML Q8_0 bytes (per block: fp16 d, then 32 int8 q; weight = d * q) to float32 `shape`."""
    shape = tuple(int(s) for s in shape)
    if isinstance(raw, bytes | bytearray | memoryview):
        buf = np.frombuffer(raw, dtype=np.uint8)
    else:
        buf = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n = math.prod(shape)
    if not shape or shape[-1] % Q8_0_BLOCK or buf.size != n // Q8_0_BLOCK * Q8_0_BLOCK_BYTES:
        raise EdgeMTPError(
            f"{name}: {buf.size} bytes do not hold a Q8_0 tensor of shape {list(shape)}; "
            "pass the tensor's own shape in numpy order"
        )
    blocks = buf.reshape(-1, Q8_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    return torch.from_numpy((q * d).reshape(shape))


class Q8_0Rows(BlockRows):
    """GGML Q8_0 blocks: fp16 scale, 32 int8 codes."""

    block_bytes = Q8_0_BLOCK_BYTES
    symbol = "edgemtp_q8_0_rows"

    def dequantize(self, rows: np.ndarray) -> np.ndarray:
        return dequantize_q8_0(rows, (rows.shape[0], self.shape[1])).numpy()


@dataclass(frozen=True)
class _Stored:
    gguf_name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # the float shape, PyTorch order
    data: np.ndarray  # the reader's memmap: typed for F32/F16, uint8 bytes otherwise


class GGUFSource(TensorSource):
    """A Gemma 4 GGUF file, served under Hugging Face tensor names with a rebuilt HF config.

    Quantized weights are never re-quantized: `quantized(name)` gives the stored Q4_0 blocks,
    `tensor(name)` their exact dequantization, `table(name)` a row-lookup over the mapped file.
    """

    def __init__(self, path: Path):
        path = Path(path)
        self.path = path
        self._reader = _open(path)
        arch = self._get("general.architecture", None)
        if arch != ARCH:
            raise EdgeMTPError(
                f"{path}: GGUF architecture '{arch}' is not supported (edgemtp imports Gemma 4 "
                f"GGUF files, architecture '{ARCH}')"
            )
        if self._int("split.count", 1) > 1:
            raise EdgeMTPError(
                f"{path}: this is one part of a split GGUF; merge the parts into one file "
                "(llama-gguf-split --merge) and pass that"
            )
        if self._reader.byte_order != "I":
            raise EdgeMTPError(f"{path}: big-endian GGUF files are not supported; {_FIX_CONVERT}")
        self._stored: dict[str, _Stored] = {}
        self._rope_freqs: np.ndarray | None = None
        for t in self._reader.tensors:
            self._add(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data)
        config = self._build_config()
        super().__init__(path, config)
        self.text_config = parse_text_config(config, str(path))
        self._check_shapes(self.text_config)

    # --- TensorSource -------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._stored)

    def raw(self, name: str) -> torch.Tensor:
        """The stored data, memory-mapped: floats in their dtype and PyTorch shape, quantized
        tensors as uint8 [rows, bytes per row]."""
        s = self._entry(name)
        if s.type == _T.BF16:
            return torch.from_numpy(s.data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(s.data)

    def tensor(self, name: str) -> torch.Tensor:
        """Float32 weights; Q4_0 and Q8_0 are dequantized exactly."""
        s = self._entry(name)
        if s.type == _T.Q4_0:
            return dequantize_q4_0(self._q4_0(s, name))
        if s.type == _T.Q8_0:
            return dequantize_q8_0(s.data, s.shape, name)
        return self.raw(name).float()

    def table(self, name: str) -> Rows:
        """A lookup table over the mapped file: rows are dequantized only when looked up."""
        s = self._entry(name)
        if len(s.shape) != 2:
            raise EdgeMTPError(f"{self.path}: '{s.gguf_name}' is not a 2-D table")
        if s.type == _T.Q4_0:
            return Q4_0Rows(s.data, s.shape[1])
        if s.type == _T.Q8_0:
            return Q8_0Rows(s.data, s.shape[1])
        return self.raw(name)

    def quantized(self, name: str) -> Q4_0 | None:
        """The stored Q4_0 blocks of a weight (never re-quantized), or None if not Q4_0."""
        s = self._entry(name)
        return self._q4_0(s, name) if s.type == _T.Q4_0 else None

    def scheme_4bit(self, name: str) -> str | None:
        s = self._stored.get(name)
        return "q4_0" if s is not None and s.type == _T.Q4_0 else None

    def shape_4bit(self, name: str) -> tuple[int, int] | None:
        s = self._stored.get(name)
        return (s.shape[0], s.shape[1]) if s is not None and s.type == _T.Q4_0 else None

    def gguf_name(self, name: str) -> str:
        """The GGUF name of a Hugging Face tensor name."""
        return self._entry(name).gguf_name

    # --- reading ------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Stored:
        try:
            return self._stored[name]
        except KeyError:
            raise EdgeMTPError(f"{self.path}: tensor '{name}' is not in this GGUF file") from None

    def _q4_0(self, s: _Stored, name: str) -> Q4_0:
        return unpack_q4_0(s.data, s.shape, name)

    def _add(
        self, gguf_name: str, kind: GGMLQuantizationType, shape: tuple[int, ...], data: np.ndarray
    ) -> None:
        if gguf_name == _ROPE_FREQS:
            if kind != _T.F32 or len(shape) != 1:
                raise EdgeMTPError(
                    f"{self.path}: '{_ROPE_FREQS}' must be a 1-D F32 tensor, got {kind.name} "
                    f"{list(shape)}; {_FIX_CONVERT}"
                )
            self._rope_freqs = np.asarray(data, dtype=np.float32)
            return
        hf = _hf_name(gguf_name)
        if hf is None:
            if any(part in gguf_name for part in _MOE_PARTS):
                raise EdgeMTPError(
                    f"{self.path}: tensor '{gguf_name}' belongs to a Mixture-of-Experts Gemma 4; "
                    "edgemtp supports the dense edge models (E2B, E4B)"
                )
            raise EdgeMTPError(
                f"{self.path}: tensor '{gguf_name}' has no place in a Gemma 4 text decoder "
                f"(is this a projector/mmproj file or a newer converter's output?); {_FIX_CONVERT}"
            )
        if kind not in SUPPORTED:
            raise EdgeMTPError(f"{self.path}: tensor '{gguf_name}' is {kind.name}; {_FIX_TYPES}")
        if kind in (_T.Q4_0, _T.Q8_0) and len(shape) not in (1, 2):
            raise EdgeMTPError(
                f"{self.path}: tensor '{gguf_name}' is a {len(shape)}-D {kind.name} tensor; "
                "edgemtp reads 1-D and 2-D quantized tensors"
            )
        self._stored[hf] = _Stored(gguf_name, kind, shape, data)

    def _get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise EdgeMTPError(
                    f"{self.path}: GGUF metadata has no '{key}' (not a complete Gemma 4 GGUF); "
                    f"{_FIX_CONVERT}"
                )
            return default
        try:
            return field.contents()
        except Exception as err:  # gguf-py raises assorted errors on malformed fields
            raise EdgeMTPError(f"{self.path}: GGUF field '{key}' is unreadable ({err})") from None

    def _int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise EdgeMTPError(f"{self.path}: GGUF field '{key}' is {value!r}, not an integer")
        return int(value)

    def _float(self, key: str, default: Any = _REQUIRED) -> Any:
        """A float field (None when absent and the default is None)."""
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EdgeMTPError(f"{self.path}: GGUF field '{key}' is {value!r}, not a number")
        return _decimal(value)

    def _per_layer(self, key: str, n: int, default: Any = _REQUIRED) -> list[int]:
        """A per-layer value: an array of n, or one scalar for every layer (llama.cpp's
        get_key_or_arr)."""
        value = self._get(key, default)
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n or not all(isinstance(v, int | bool) for v in values):
            raise EdgeMTPError(
                f"{self.path}: GGUF field '{key}' must hold one integer or {n} (one per layer), "
                f"got {value!r}; {_FIX_CONVERT}"
            )
        return [int(v) for v in values]

    def _rows(self, name: str) -> int:
        s = self._stored.get(name)
        if s is None:
            gguf_name = next(k for k, v in _GLOBAL.items() if v == name)
            raise EdgeMTPError(f"{self.path}: tensor '{gguf_name}' is missing; {_FIX_CONVERT}")
        return s.shape[0]

    # --- metadata -> Hugging Face config ------------------------------------------------------

    def _build_config(self) -> dict[str, Any]:
        """A `gemma4_text` config.json dict from the `gemma4.*` and `tokenizer.ggml.*` keys."""
        where = str(self.path)
        k = ARCH + "."
        n = self._int(k + "block_count")
        if n <= 0:
            raise EdgeMTPError(f"{where}: GGUF field '{k}block_count' is {n}; {_FIX_CONVERT}")
        swa = [bool(v) for v in self._per_layer(k + "attention.sliding_window_pattern", n)]
        if swa[-1]:
            raise EdgeMTPError(
                f"{where}: the last layer is a sliding-window layer; Gemma 4 (transformers) always "
                f"ends with a full-attention layer; {_FIX_CONVERT}"
            )
        layer_types = ["sliding_attention" if s else "full_attention" for s in swa]
        heads = _uniform(self._per_layer(k + "attention.head_count", n), "head_count", where)
        kv = self._per_layer(k + "attention.head_count_kv", n, heads)
        kv_swa = _uniform([h for h, s in zip(kv, swa, strict=True) if s], "sliding KV heads", where)
        kv_full = _uniform(
            [h for h, s in zip(kv, swa, strict=True) if not s], "full KV heads", where
        )
        hd_full = self._int(k + "attention.key_length")
        _same(hd_full, self._int(k + "attention.value_length", hd_full), "value_length", where)
        hd_swa = self._int(k + "attention.key_length_swa", hd_full if not any(swa) else _REQUIRED)
        _same(hd_swa, self._int(k + "attention.value_length_swa", hd_swa), "value_length", where)

        num_shared = self._int(k + "attention.shared_kv_layers", 0)
        if not 0 <= num_shared < n:
            raise EdgeMTPError(f"{where}: shared_kv_layers={num_shared} is out of range")
        first_shared = n - num_shared
        self._check_store_layers(swa, first_shared)

        n_ff = self._per_layer(k + "feed_forward_length", n)
        intermediate = n_ff[0]
        _uniform(n_ff[:first_shared], "feed_forward_length of layers with their own KV", where)
        shared_ff = set(n_ff[first_shared:])
        if shared_ff - {intermediate, 2 * intermediate} or len(shared_ff) > 1:
            raise EdgeMTPError(
                f"{where}: KV-shared layers have feed_forward_length {sorted(shared_ff)}; "
                f"Gemma 4 allows {intermediate} or {2 * intermediate} (double-wide MLP)"
            )
        double_wide = shared_ff == {2 * intermediate}

        ple = self._int(k + "embedding_length_per_layer_input", 0)
        vocab = self._rows("model.embed_tokens.weight")
        vocab_ple = self._rows("model.embed_tokens_per_layer.weight") if ple else 0

        own_full = [i for i in range(first_shared) if not swa[i]]
        has_v = {i: f"model.layers.{i}.self_attn.v_proj.weight" in self._stored for i in range(n)}
        if any(not has_v[i] for i in range(first_shared) if swa[i]):
            raise EdgeMTPError(
                f"{where}: a sliding-window layer has no attn_v (V = K); transformers' Gemma 4 "
                "shares K and V only in full-attention layers"
            )
        k_eq_v = bool(own_full) and not any(has_v[i] for i in own_full)
        if not k_eq_v and not all(has_v[i] for i in own_full):
            raise EdgeMTPError(
                f"{where}: only some full-attention layers have attn_v; Gemma 4's "
                f"attention_k_eq_v holds for all of them or none; {_FIX_CONVERT}"
            )

        config: dict[str, Any] = {
            "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": self._int(k + "embedding_length"),
            "intermediate_size": intermediate,
            "num_hidden_layers": n,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_swa if any(swa) else kv_full,
            "head_dim": hd_swa if any(swa) else hd_full,
            "global_head_dim": hd_full,
            "per_layer_config": {
                str(i): {"head_dim": hd_full, "num_key_value_heads": kv_full}
                for i in range(n)
                if not swa[i]
            },
            "layer_types": layer_types,
            "sliding_window": self._int(k + "attention.sliding_window"),
            "rope_parameters": self._rope_parameters(hd_full, hd_swa, any(swa)),
            "rms_norm_eps": self._float(k + "attention.layer_norm_rms_epsilon"),
            "final_logit_softcapping": self._float(k + "final_logit_softcapping", None),
            "hidden_size_per_layer_input": ple,
            "vocab_size_per_layer_input": vocab_ple,
            "num_kv_shared_layers": num_shared,
            "use_double_wide_mlp": double_wide,
            "attention_k_eq_v": k_eq_v,
            "max_position_embeddings": self._int(k + "context_length", 131072),
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": "lm_head.weight" not in self._stored,
        }
        if k_eq_v:
            config["num_global_key_value_heads"] = kv_full
        if self._get(k + "expert_count", 0):
            raise EdgeMTPError(
                f"{where}: Mixture-of-Experts Gemma 4 models are not supported; edgemtp targets "
                "the dense edge models (E2B, E4B)"
            )
        config.update(self._token_ids())
        return config

    def _rope_parameters(self, hd_full: int, hd_swa: int, has_swa: bool) -> dict[str, Any]:
        """Full layers: proportional RoPE whose rotated part `rope_freqs` encodes; sliding layers:
        default RoPE over the whole head."""
        k, where = ARCH + ".rope.", str(self.path)
        scaling = self._get(k + "scaling.type", None)
        if scaling not in (None, "none"):
            raise EdgeMTPError(f"{where}: RoPE scaling '{scaling}' is not supported for Gemma 4")
        theta = self._float(k + "freq_base")
        if self._int(k + "dimension_count", hd_full) != hd_full:
            raise EdgeMTPError(
                f"{where}: rope.dimension_count must equal the full layers' head size {hd_full} "
                f"(the rotated part is given by '{_ROPE_FREQS}'); {_FIX_CONVERT}"
            )
        params: dict[str, Any] = {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": self._partial_rotary(hd_full),
                "rope_theta": theta,
            }
        }
        if has_swa:
            if self._int(k + "dimension_count_swa", hd_swa) != hd_swa:
                raise EdgeMTPError(
                    f"{where}: partial RoPE in sliding-window layers (rope.dimension_count_swa "
                    f"< {hd_swa}) is not supported for Gemma 4"
                )
            theta_swa = self._float(k + "freq_base_swa", theta)
            params["sliding_attention"] = {"rope_type": "default", "rope_theta": theta_swa}
        return params

    def _partial_rotary(self, hd_full: int) -> float:
        """Rotated fraction of a full layer's head: rope_freqs is 1.0 for the rotated angle pairs
        and 1e30 (no rotation) for the rest; without it every pair rotates."""
        f = self._rope_freqs
        if f is None:
            return 1.0
        rotated = int(np.argmax(f != 1.0)) if (f != 1.0).any() else f.size
        if f.size != hd_full // 2 or not (f[rotated:] >= _UNROTATED).all():
            raise EdgeMTPError(
                f"{self.path}: '{_ROPE_FREQS}' ({f.size} factors) is not Gemma 4's proportional "
                f"RoPE (1.0 for {hd_full // 2} or fewer leading pairs, 1e30 after); {_FIX_CONVERT}"
            )
        return 2 * rotated / hd_full

    def _token_ids(self) -> dict[str, Any]:
        t = "tokenizer.ggml."
        out: dict[str, Any] = {}
        bos, pad = self._get(t + "bos_token_id", None), self._get(t + "padding_token_id", None)
        if bos is not None:
            out["bos_token_id"] = int(bos)
        if pad is not None:
            out["pad_token_id"] = int(pad)
        # llama.cpp ends generation at EOS and also at EOT / EOM when the file names them.
        eos = [self._get(t + key, None) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        if ids:
            out["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        return out

    def _check_store_layers(self, swa: list[bool], first_shared: int) -> None:
        """llama.cpp reads KV-shared sliding layers from layer first_shared - 2 and full ones from
        first_shared - 1; transformers from the last earlier layer of the same kind."""
        for kind in (True, False):
            if kind not in swa[first_shared:]:
                continue
            llama = first_shared - (2 if kind else 1)
            hf = max((i for i in range(first_shared) if swa[i] == kind), default=None)
            if llama != hf:
                name = "sliding-window" if kind else "full-attention"
                raise EdgeMTPError(
                    f"{self.path}: the KV-shared {name} layers would reuse layer {llama} in "
                    f"llama.cpp but layer {hf} in transformers; Gemma 4 GGUF files need the "
                    f"store layers (sliding, then full) right before the first shared layer "
                    f"({first_shared})"
                )

    def _check_shapes(self, cfg: TextConfig) -> None:
        with torch.device("meta"):
            model = Gemma4Target(cfg)
        expected = {
            (k if k == "lm_head.weight" else "model." + k): tuple(v.shape)
            for k, v in model.state_dict().items()
        }
        expected["model.embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
        if cfg.hidden_size_per_layer_input:
            expected["model.embed_tokens_per_layer.weight"] = (
                cfg.vocab_size_per_layer_input,
                cfg.num_layers * cfg.hidden_size_per_layer_input,
            )
        for name, s in self._stored.items():
            want = expected.get(name)
            if want is None:
                m = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(k|v)_proj\.weight", name)
                if not m or int(m[1]) >= cfg.num_layers:
                    continue
                spec = cfg.layers[int(m[1])]  # K/V of a KV-shared layer: unused, still checked
                want = (spec.num_kv_heads * spec.head_dim, cfg.hidden_size)
            if s.shape != want:
                raise EdgeMTPError(
                    f"{self.path}: tensor '{s.gguf_name}' ({name}) has shape {list(s.shape)}, "
                    f"the GGUF metadata implies {list(want)}; the file's tensors and metadata "
                    f"disagree ({_FIX_CONVERT})"
                )


# GGUF value types: fixed sizes of the scalars; 8 = string, 9 = array (GGUF spec, v2 and v3)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


def check_gguf_layout(buf: bytes | mmap.mmap, where: Path) -> None:
    """Walk a GGUF header (key-values and tensor infos) with every count and length checked
    against the bytes left, before gguf-py reads it: its reader trusts counts, so one bit flipped
    in an array length makes it loop for minutes or allocate gigabytes."""
    size, pos = len(buf), 0

    def fail(what: str) -> EdgeMTPError:
        return EdgeMTPError(
            f"{where}: not a readable GGUF file, or truncated ({what} at byte {pos} of "
            f"{size}); download or convert it again"
        )

    def take(fmt: str, what: str) -> int:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise fail(f"{what} past the end")
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += n
        return value

    def skip(n: int, what: str) -> None:
        nonlocal pos
        if n > size - pos:
            raise fail(f"{what} of {n} bytes past the end")
        pos += n

    def value(vtype: int, depth: int = 0) -> None:
        if vtype in _SCALAR_BYTES:
            skip(_SCALAR_BYTES[vtype], "value")
        elif vtype == _STRING:
            skip(take("<Q", "string length"), "string")
        elif vtype == _ARRAY and depth < 2:
            item, count = take("<I", "array type"), take("<Q", "array length")
            least = _SCALAR_BYTES.get(item, 8 if item == _STRING else 12)
            if count * least > size - pos:
                raise fail(f"array of {count} items")
            if item in _SCALAR_BYTES:
                skip(count * least, "array")
            else:
                for _ in range(count):
                    value(item, depth + 1)
        else:
            raise fail(f"value type {vtype}")

    if take("<I", "magic") != 0x46554747:  # b"GGUF"
        raise fail("no GGUF magic")
    version = take("<I", "version")
    if version not in (2, 3):
        raise fail(f"version {version}, not 2 or 3")
    tensors, entries = take("<Q", "tensor count"), take("<Q", "key-value count")
    if entries * 12 + tensors * 24 > size - pos:
        raise fail(f"{entries} key-values and {tensors} tensors declared")
    for _ in range(entries):
        skip(take("<Q", "key length"), "key")
        value(take("<I", "value type"))
    for _ in range(tensors):
        skip(take("<Q", "tensor name length"), "tensor name")
        dims = take("<I", "tensor rank")
        if not 0 < dims <= _MAX_DIMS:
            raise fail(f"tensor rank {dims}")
        skip(8 * dims + 4 + 8, "tensor info")


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise EdgeMTPError(f"{path}: no such file; pass a .gguf file or a Hugging Face folder")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            check_gguf_layout(buf, path)
    except ValueError:  # mmap of an empty file
        raise EdgeMTPError(f"{path}: not a readable GGUF file, or truncated (empty)") from None
    try:
        # copy-on-write mapping: writable arrays for torch.from_numpy, the file is never written
        return GGUFReader(path, "c")
    except Exception as err:  # gguf-py raises ValueError, IndexError, KeyError, OSError, ...
        detail = " ".join(str(err).split())[:200] or type(err).__name__
        raise EdgeMTPError(
            f"{path}: not a readable GGUF file, or truncated ({detail}); download or convert it "
            "again"
        ) from None


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if m and m[2] in _BLOCK:
        return f"model.layers.{int(m[1])}.{_BLOCK[m[2]]}"
    return None


def _decimal(value: float) -> float:
    """GGUF stores float32: give back the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07), i.e. the value the Hugging Face config most likely held."""
    return float(str(np.float32(value))) if np.isfinite(np.float32(value)) else float(value)


def _uniform(values: list[int], what: str, where: str) -> int:
    if not values:
        return 0
    if len(set(values)) != 1:
        raise EdgeMTPError(
            f"{where}: {what} differs between layers ({sorted(set(values))}); edgemtp's Gemma 4 "
            "needs one value per attention kind"
        )
    return values[0]


def _same(a: int, b: int, what: str, where: str) -> None:
    if a != b:
        raise EdgeMTPError(f"{where}: {what} {b} differs from key_length {a}; Gemma 4 needs K = V")
