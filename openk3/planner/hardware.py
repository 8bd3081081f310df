"""Hardware catalogue: accelerators and the systems built from them, every figure with its source.

The shipped rows live in `catalogue.json` (human units: GB, GB/s, TB/s, TFLOP/s, W, $/h); a user file in the same shape
(JSON or YAML) adds rows or replaces figures. Loading converts to SI (bytes, bytes/s, FLOP/s, seconds) so the models
never juggle units. Bandwidths are per direction per accelerator; a figure missing from a row is None, never 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

CATALOGUE_PATH = Path(__file__).with_name("catalogue.json")
PLACEHOLDER = "[placeholder]"  # a figure's source starting with this is a stand-in, not a published or measured value

# json key -> (dataclass field, factor to SI, required)
_ACCEL_KEYS = {
    "hbm_gb": ("hbm_bytes", 1e9, True),
    "hbm_visible_gb": ("hbm_visible_bytes", 1e9, False),
    "hbm_bw_tbps": ("hbm_bw", 1e12, True),
    "bf16_tflops": ("bf16_flops", 1e12, True),
    "fp8_tflops": ("fp8_flops", 1e12, False),
    "fp4_tflops": ("fp4_flops", 1e12, False),
    "scale_up_gbps": ("scale_up_bw", 1e9, True),
    "tdp_w": ("tdp_w", 1.0, True),
}
_SYSTEM_KEYS = {
    "accelerators_per_unit": ("accelerators_per_unit", 1, True),
    "scale_up_domain": ("scale_up_domain", 1, True),
    "scale_out_gbps": ("scale_out_bw", 1e9, True),
    "host_mem_gb": ("host_mem_bytes", 1e9, True),
    "host_link_gbps": ("host_link_bw", 1e9, True),
    "nvme_gbps": ("nvme_bw", 1e9, True),
    "nvme_gb": ("nvme_bytes", 1e9, True),
    "power_w": ("power_w", 1.0, True),
    "price_per_hour": ("price_per_hour", 1.0, True),
}


class Vendor(Enum):
    """Who makes the accelerator: it decides which engines and which collective library can run a plan on it."""

    NVIDIA = "nvidia"
    AMD = "amd"

    @property
    def scale_up_fabric(self) -> str:
        return {Vendor.NVIDIA: "NVLink", Vendor.AMD: "Infinity Fabric"}[self]


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes: float
    hbm_bw: float
    bf16_flops: float
    scale_up_bw: float  # per direction
    tdp_w: float
    hbm_visible_bytes: float | None = None
    fp8_flops: float | None = None
    fp4_flops: float | None = None
    vendor: Vendor | None = None  # None: a user row that does not say; then no engine is matched to it
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def usable_hbm(self) -> float:
        return self.hbm_visible_bytes if self.hbm_visible_bytes is not None else self.hbm_bytes

    def flops(self, precision: str) -> float:
        """Dense peak for a GEMM precision; a missing format falls back to the next wider one (as the hardware runs it)."""
        order = {"fp4": ("fp4_flops", "fp8_flops", "bf16_flops"), "fp8": ("fp8_flops", "bf16_flops"), "bf16": ("bf16_flops",)}
        if precision not in order:
            raise ValueError(f"precision={precision!r} is invalid: expected one of {sorted(order)}")
        for name in order[precision]:
            value = getattr(self, name)
            if value is not None:
                return float(value)
        raise AssertionError("bf16_flops is required")


@dataclass(frozen=True)
class System:
    name: str
    accelerator: Accelerator
    accelerators_per_unit: int  # one buyable unit: an 8-GPU node or a 72-GPU rack
    scale_up_domain: int  # accelerators sharing the scale-up fabric (NVLink)
    scale_out_bw: float  # NIC, per accelerator, per direction
    host_mem_bytes: float  # per accelerator
    host_link_bw: float  # HBM <-> host DRAM, per accelerator, per direction
    nvme_bw: float  # per accelerator
    nvme_bytes: float  # per accelerator
    power_w: float  # wall power per accelerator (its share of CPU, NIC, switches, cooling)
    price_per_hour: float  # USD per accelerator-hour: an input
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def price_is_placeholder(self) -> bool:
        """The catalogue has no published rate for this system: its price is a stand-in the user should replace."""
        return self.sources.get("price_per_hour", "").startswith(PLACEHOLDER)

    def with_price(self, price_per_hour: float) -> System:
        if not price_per_hour > 0:
            raise ValueError(f"price_per_hour={price_per_hour!r} is invalid: expected > 0 (USD per accelerator-hour)")
        sources = {**self.sources, "price_per_hour": "user input"}
        return replace(self, price_per_hour=price_per_hour, sources=sources)


def _figure(row_name: str, key: str, raw: Any) -> tuple[float, str]:
    if isinstance(raw, Mapping):
        if "value" not in raw or "source" not in raw:
            raise ValueError(f"catalogue row {row_name!r}: {key} must be {{'value': number, 'source': text}}, got {dict(raw)!r}")
        value, source = raw["value"], str(raw["source"])
    else:
        raise ValueError(f"catalogue row {row_name!r}: {key}={raw!r} has no source; write {{'value': {raw!r}, 'source': '...'}}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"catalogue row {row_name!r}: {key}={value!r} is invalid: expected a positive number")
    return float(value), source


def _vendor(row_name: str, raw: Any) -> tuple[Vendor, str]:
    if not isinstance(raw, Mapping) or "value" not in raw or "source" not in raw:
        raise ValueError(f"catalogue row {row_name!r}: vendor must be {{'value': 'nvidia' | 'amd', 'source': text}}, got {raw!r}")
    try:
        return Vendor(raw["value"]), str(raw["source"])
    except ValueError:
        raise ValueError(f"catalogue row {row_name!r}: vendor={raw['value']!r} is invalid: expected one of {[v.value for v in Vendor]}") from None


def _convert(row_name: str, row: Mapping[str, Any], keys: Mapping[str, tuple[str, float, bool]]) -> tuple[dict[str, Any], dict[str, str]]:
    text_keys = {"accelerator"} if keys is _SYSTEM_KEYS else {"vendor"}
    unknown = set(row) - set(keys) - text_keys
    if unknown:
        raise ValueError(f"catalogue row {row_name!r}: unknown fields {sorted(unknown)}; expected {sorted(keys)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, (attr, factor, required) in keys.items():
        if key not in row:
            if required:
                raise ValueError(f"catalogue row {row_name!r}: missing required figure {key!r}")
            continue
        value, source = _figure(row_name, key, row[key])
        values[attr] = int(value) if factor == 1 and isinstance(factor, int) else value * factor
        sources[attr] = source
    if "vendor" in text_keys and "vendor" in row:
        values["vendor"], sources["vendor"] = _vendor(row_name, row["vendor"])
    return values, sources


@dataclass(frozen=True)
class Catalogue:
    accelerators: Mapping[str, Accelerator]
    systems: Mapping[str, System]

    def system(self, name: str) -> System:
        try:
            return self.systems[name]
        except KeyError:
            raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(self.systems)} or add it with --catalogue FILE") from None

    def extended(self, data: Mapping[str, Any]) -> Catalogue:
        """A new catalogue with the rows of `data` added; a row with an existing name replaces the figures it names."""
        raw_acc: dict[str, dict[str, Any]] = {k: dict(v) for k, v in _raw_rows(self.accelerators, _ACCEL_KEYS).items()}
        raw_sys: dict[str, dict[str, Any]] = {k: dict(v) for k, v in _raw_rows(self.systems, _SYSTEM_KEYS).items()}
        for name, row in (data.get("accelerators") or {}).items():
            raw_acc[name] = {**raw_acc.get(name, {}), **row}
        for name, row in (data.get("systems") or {}).items():
            raw_sys[name] = {**raw_sys.get(name, {}), **row}
        return _build({"accelerators": raw_acc, "systems": raw_sys})


def _raw_rows(rows: Mapping[str, Any], keys: Mapping[str, tuple[str, float, bool]]) -> dict[str, dict[str, Any]]:
    """Back to the file form, so extension can merge field by field."""
    out: dict[str, dict[str, Any]] = {}
    for name, obj in rows.items():
        row: dict[str, Any] = {}
        for key, (attr, factor, _) in keys.items():
            value = getattr(obj, attr)
            if value is not None:
                row[key] = {"value": value / factor, "source": obj.sources.get(attr, "")}
        if isinstance(obj, System):
            row["accelerator"] = obj.accelerator.name
        elif obj.vendor is not None:
            row["vendor"] = {"value": obj.vendor.value, "source": obj.sources.get("vendor", "")}
        out[name] = row
    return out


def _build(data: Mapping[str, Any]) -> Catalogue:
    accelerators: dict[str, Accelerator] = {}
    for name, row in (data.get("accelerators") or {}).items():
        values, sources = _convert(name, row, _ACCEL_KEYS)
        accelerators[name] = Accelerator(name=name, sources=sources, **values)
    systems: dict[str, System] = {}
    for name, row in (data.get("systems") or {}).items():
        acc_name = row.get("accelerator")
        if acc_name not in accelerators:
            raise ValueError(f"catalogue system {name!r}: accelerator={acc_name!r} is not in the catalogue ({sorted(accelerators)})")
        values, sources = _convert(name, row, _SYSTEM_KEYS)
        systems[name] = System(name=name, accelerator=accelerators[acc_name], sources=sources, **values)
    return Catalogue(accelerators=accelerators, systems=systems)


def _read(path: Path) -> Mapping[str, Any]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping with 'accelerators' and/or 'systems'")
    return data


def load_catalogue(extra: str | Path | None = None) -> Catalogue:
    """The shipped catalogue, extended by a user JSON/YAML file when given."""
    catalogue = _build(_read(CATALOGUE_PATH))
    return catalogue if extra is None else catalogue.extended(_read(Path(extra)))
