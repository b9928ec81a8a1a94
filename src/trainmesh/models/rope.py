"""RoPE scaling in transformers' ``modeling_rope_utils`` conventions, so a checkpoint's ``rope_scaling`` means the same:
linear (Chen et al., 2023, Positional Interpolation), llama3 (Grattafiori et al., 2024) and yarn (Peng et al., 2023,
YaRN, §3.2-3.4, eq. 21; DeepSeek's gain in :func:`softmax_gain`). Other types are refused by name on import."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainmesh.models.spec import HFIncompatible

KINDS = ("linear", "llama3", "yarn")
IGNORED_KEYS = ("rope_type", "type", "rope_theta")
"""Keys of a Hugging Face rope dict that are not :class:`RopeScaling` fields: its type (either spelling) and
the base, which :class:`~trainmesh.models.llama.LlamaConfig` holds as ``rope_theta``."""


@dataclass(frozen=True)
class RopeScaling:
    """One rope scaling, fields named as in Hugging Face's rope dict, each type reading its own (linear ``factor``;
    llama3 the frequency factors; yarn ``beta_*``, ``mscale*`` or ``attention_factor`` and ``truncate``)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in KINDS:
            raise ValueError(f"rope type {self.rope_type!r} is not implemented by trainmesh (it has "
                             f"{', '.join(KINDS)}); use a checkpoint with one of those or none")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "float" in str(f.type) and value is not None and not _finite(value):
                raise ValueError(f"rope scaling's {f.name} is {value!r}; it must be a finite number")
        if self.factor < 1:
            raise ValueError(f"rope scaling factor is {self.factor!r}; it must be at least 1")
        original = self.original_max_position_embeddings
        if self.rope_type != "linear" and not (type(original) is int and original >= 1):
            raise ValueError(f"{self.rope_type} rope scaling needs original_max_position_embeddings, a whole "
                             f"number of at least 1, not {original!r}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, not "
                             f"{self.low_freq_factor!r} and {self.high_freq_factor!r}")


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _base_frequencies(head_dim: int, theta: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2 (Su et al., 2021, RoFormer, eq. 15)."""
    return theta ** -(torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim)


def _llama3(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths interpolated by ``factor``, short ones kept, the band between blended."""
    wavelength = 2 * math.pi / freq
    original = s.original_max_position_embeddings
    blend = ((original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return (1 - blend) * freq / s.factor + blend * freq


def _yarn_dimension(turns: float, head_dim: int, theta: float, original: int) -> float:
    """The (fractional) dimension index whose frequency turns ``turns`` times over ``original`` tokens
    (YaRN, §3.2: r(d) = L / λ_d solved for d)."""
    return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))


def _yarn(freq: torch.Tensor, s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """Dimensions below the ``beta_fast`` one keep their frequency, those above the ``beta_slow`` one are
    interpolated by ``factor``, a linear ramp between (YaRN's "NTK-by-parts", eq. 18-19)."""
    original = s.original_max_position_embeddings
    low = _yarn_dimension(s.beta_fast, head_dim, theta, original)
    high = _yarn_dimension(s.beta_slow, head_dim, theta, original)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if high == low else high  # a one-step ramp where the range collapses, as transformers
    ramp = ((torch.arange(freq.numel(), dtype=freq.dtype, device=freq.device) - low) / (high - low)).clamp(0, 1)
    return freq / s.factor * ramp + freq * (1 - ramp)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """The ``head_dim/2`` rotary frequencies of base ``theta``, scaled by ``scaling`` (None: unscaled)."""
    freq = _base_frequencies(head_dim, theta, dtype, device)
    if scaling is None:
        return freq
    if scaling.rope_type == "linear":
        return freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(freq, scaling)
    return _yarn(freq, scaling, head_dim, theta)


def _yarn_mscale(factor: float, coefficient: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 k ln(s) + 1 (eq. 21), 1 for no stretch."""
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's temperature (as a factor on q and k, so on their dot
    product squared), 1 for the other types."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def softmax_gain(scaling: RopeScaling | None) -> float:
    """The factor DeepSeek's latent attention multiplies its softmax scale by: ``mscale_all_dim``'s
    temperature squared, which reaches the unrotated features too (DeepSeek-V2's reference code)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """The base and scaling of a HF config dict (``rope_parameters`` in transformers 5, else ``rope_scaling`` and
    ``rope_theta``); refused in one line for a type or key trainmesh does not compute."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in KINDS:
        raise HFIncompatible(f"rope type is {kind!r}; trainmesh implements {', '.join(('default', *KINDS))}, so "
                             f"this checkpoint cannot be imported")
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(k for k in rope if k not in fields and k not in IGNORED_KEYS)
    if unknown:
        raise HFIncompatible(f"{kind} rope has {', '.join(unknown)}, which trainmesh does not compute, so this "
                             f"checkpoint cannot be imported")
    values = {k: v for k, v in rope.items() if k in fields and v is not None}
    if "factor" not in values and kind == "yarn" and values.get("original_max_position_embeddings"):
        values["factor"] = hf["max_position_embeddings"] / values["original_max_position_embeddings"]
    try:
        return theta, RopeScaling(**{**values, "rope_type": kind})
    except (TypeError, ValueError) as e:
        raise HFIncompatible(str(e)) from None


def rope_to_hf(scaling: RopeScaling | None) -> dict[str, Any]:
    """``scaling`` as the ``rope_scaling`` attribute transformers' configs take (5 turns it into ``rope_parameters``):
    the fields its type reads and any other set away from its default; nothing for an unscaled rope."""
    if scaling is None:
        return {}
    read = {"linear": ("factor",),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
            "yarn": ("factor", "original_max_position_embeddings")}[scaling.rope_type]
    values = {f.name: getattr(scaling, f.name) for f in dataclasses.fields(RopeScaling)[1:]
              if f.name in read or getattr(scaling, f.name) != f.default}
    values = {k: v for k, v in values.items() if v is not None}
    return {"rope_scaling": {"rope_type": scaling.rope_type, **values}}
