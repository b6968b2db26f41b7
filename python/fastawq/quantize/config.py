"""The quantization config: a validated dataclass that reads and writes AutoAWQ's and HF's keys."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

# AutoAWQ's quant_config keys -> ours (HF's quantization_config uses bits / group_size).
_ALIASES = {"w_bit": "w_bit", "bits": "w_bit", "q_group_size": "q_group_size", "group_size": "q_group_size"}
# Keys AutoAWQ / transformers' AwqConfig write that fastawq does not need: kept quietly.
_FOREIGN_KEYS = frozenset({
    "backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config", "start_pos",
    "modules_to_preserve", "linear_type", "_load_in_4bit", "_load_in_8bit",
})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class QuantConfig:
    """What to quantize and how.

    w_bit: 4 packs into the AWQ "GEMM" layout; 2, 3 and 8 are accepted for pseudo-quantized
        evaluation only (the weights stay floating point).
    q_group_size: input channels sharing one scale and zero; -1 = one group per output row.
    fallback_group_size: used for a layer whose in_features the group size does not divide
        (e.g. hidden 576 with g128); None makes that an error naming the layer.
    modules_to_not_convert: substrings of linear names kept in full precision.
    """

    w_bit: int = 4
    q_group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] | None = None
    fallback_group_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Strict types: a config read from JSON or a CLI must not turn "false" into True or a
        # string into a list of its characters.
        if not _is_int(self.w_bit) or self.w_bit not in (2, 3, 4, 8):
            raise ValueError(f"w_bit must be one of 2, 3, 4, 8 (int), got {self.w_bit!r}")
        if not _is_int(self.q_group_size) or (self.q_group_size <= 0 and self.q_group_size != -1):
            raise ValueError(f"q_group_size must be a positive int or -1, got {self.q_group_size!r}")
        if self.fallback_group_size is not None and (
            not _is_int(self.fallback_group_size) or self.fallback_group_size <= 0
        ):
            raise ValueError(f"fallback_group_size must be a positive int or None, got {self.fallback_group_size!r}")
        if not isinstance(self.zero_point, bool):
            raise ValueError(f"zero_point must be True or False, got {self.zero_point!r} ({type(self.zero_point).__name__})")
        if not isinstance(self.version, str) or self.version.lower() != "gemm":
            raise ValueError(f"only version='gemm' is supported, got {self.version!r}")
        self.version = "gemm"
        m = self.modules_to_not_convert
        if m is not None:
            if isinstance(m, (str, bytes)) or not isinstance(m, (list, tuple)):
                raise ValueError(
                    f"modules_to_not_convert must be a list of name substrings, got {m!r}; write [{m!r}] for one"
                )
            bad = [x for x in m if not isinstance(x, str) or not x]
            if bad:
                raise ValueError(f"modules_to_not_convert entries must be non-empty strings, got {bad!r} "
                                 f"(an empty string would match every layer)")
            self.modules_to_not_convert = list(m)
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")

    @property
    def packable(self) -> bool:
        return self.w_bit == 4

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | "QuantConfig" | None) -> "QuantConfig":
        """Accepts AutoAWQ's quant_config dict, HF's quantization_config dict, or a QuantConfig."""
        if d is None:
            return cls()
        if isinstance(d, QuantConfig):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"quant_config must be a dict or QuantConfig, got {type(d).__name__}")
        method = d.get("quant_method", "awq")
        if not isinstance(method, str) or method.lower() != "awq":
            raise ValueError(f"not an AWQ config: quant_method={method!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in d.items():
            if not isinstance(k, str):
                raise ValueError(f"quant_config keys must be strings, got {k!r}")
            name = _ALIASES.get(k, k)
            if name in known:
                if name in kwargs and kwargs[name] != v:
                    raise ValueError(f"quant_config sets {name} twice with different values ({kwargs[name]!r}, {v!r})")
                kwargs[name] = v
            elif k == "quant_method":
                continue
            else:
                if k not in _FOREIGN_KEYS:
                    logging.getLogger(__name__).warning(
                        "quant_config key %r is not used by fastawq (known: %s); check its spelling",
                        k, ", ".join(sorted(known | set(_ALIASES))))
                extra[k] = v
        return cls(**kwargs, extra=extra)

    def group_size_for(self, name: str, in_features: int) -> int:
        """The group size of one layer, or an error naming it when none fits."""
        g = in_features if self.q_group_size == -1 else self.q_group_size
        if in_features % g == 0:
            return g
        fb = self.fallback_group_size
        if fb is not None and in_features % fb == 0:
            return fb
        hint = (
            f"the fallback group size {fb} does not divide it either"
            if fb is not None
            else "pass fallback_group_size (e.g. 32 or 64) to quantize such layers with a smaller group"
        )
        raise ValueError(f"layer {name!r}: in_features={in_features} is not divisible by group_size={g}; {hint}")

    def skips(self, name: str) -> bool:
        return any(m in name for m in (self.modules_to_not_convert or []))

    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` entry of config.json (transformers / vLLM / AutoAWQ).

        A fallback group size is recorded as an extra key: fastawq's loader reads each layer's
        group size from its tensors' shapes, other loaders assume `group_size` everywhere."""
        d = {
            "quant_method": "awq",
            "bits": self.w_bit,
            "group_size": self.q_group_size,
            "zero_point": self.zero_point,
            "version": self.version,
            "modules_to_not_convert": self.modules_to_not_convert,
        }
        if self.fallback_group_size is not None:
            d["fallback_group_size"] = self.fallback_group_size
            logging.getLogger(__name__).warning(
                "this checkpoint mixes group sizes (%d, and %d where %d does not divide a layer): fastawq "
                "loads it, but transformers and vLLM assume one group_size and will reject those layers",
                self.q_group_size, self.fallback_group_size, self.q_group_size,
            )
        return d

    def to_autoawq(self) -> dict[str, Any]:
        return {
            "w_bit": self.w_bit,
            "q_group_size": self.q_group_size,
            "zero_point": self.zero_point,
            "version": self.version,
            "modules_to_not_convert": self.modules_to_not_convert,
        }
