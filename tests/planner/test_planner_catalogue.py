"""Hardware catalogue: every figure carries a source, user files extend it, bad rows name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openk3.planner.hardware import CATALOGUE_PATH, load_catalogue

SPEC_SYSTEMS = ("hgx-h100", "hgx-h200", "hgx-b200", "gb200-nvl72", "hgx-b300", "gb300-nvl72", "mi300x-8", "mi355x-8")


def test_every_figure_has_a_source() -> None:
    raw = json.loads(CATALOGUE_PATH.read_text())
    for section in ("accelerators", "systems"):
        for name, row in raw[section].items():
            for key, fig in row.items():
                if key == "accelerator":
                    continue
                assert isinstance(fig, dict) and fig["source"].strip(), f"{section}.{name}.{key} has no source"


def test_spec_systems_and_si_units() -> None:
    cat = load_catalogue()
    for name in SPEC_SYSTEMS:
        assert name in cat.systems
    gb300 = cat.system("gb300-nvl72")
    assert gb300.accelerator.hbm_bytes == 288e9 and gb300.accelerator.usable_hbm == 279e9
    assert gb300.accelerator.hbm_bw == 8e12 and gb300.accelerator.flops("fp4") == 15e15
    assert gb300.scale_up_domain == 72 and gb300.scale_out_bw == 100e9
    h200 = cat.system("hgx-h200").accelerator
    assert h200.flops("fp4") == h200.flops("fp8") == 1979e12  # no FP4 units: runs at the next wider format
    assert h200.sources["hbm_bw"]


def test_user_file_extends_and_overrides(tmp_path: Path) -> None:
    yaml_text = """
accelerators:
  my-gpu:
    hbm_gb: {value: 100, source: vendor sheet}
    hbm_bw_tbps: {value: 4, source: vendor sheet}
    bf16_tflops: {value: 1000, source: vendor sheet}
    scale_up_gbps: {value: 400, source: vendor sheet}
    tdp_w: {value: 800, source: vendor sheet}
systems:
  my-box:
    accelerator: my-gpu
    accelerators_per_unit: {value: 8, source: me}
    scale_up_domain: {value: 8, source: me}
    scale_out_gbps: {value: 50, source: me}
    host_mem_gb: {value: 128, source: me}
    host_link_gbps: {value: 50, source: me}
    nvme_gbps: {value: 5, source: me}
    nvme_gb: {value: 2000, source: me}
    power_w: {value: 1200, source: me}
    price_per_hour: {value: 1.5, source: my contract}
  gb300-nvl72:
    price_per_hour: {value: 3.25, source: my contract}
"""
    path = tmp_path / "extra.yaml"
    path.write_text(yaml_text)
    cat = load_catalogue(path)
    assert cat.system("my-box").accelerator.hbm_bytes == 100e9
    gb300 = cat.system("gb300-nvl72")
    assert gb300.price_per_hour == 3.25 and gb300.sources["price_per_hour"] == "my contract"
    assert gb300.accelerator.hbm_bw == 8e12  # untouched figures stay
    assert cat.system("gb300-nvl72").with_price(9.0).price_per_hour == 9.0


def test_bad_rows_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"systems": {"gb300-nvl72": {"power_w": 1500}}}))
    with pytest.raises(ValueError, match="power_w=1500 has no source"):
        load_catalogue(path)
    path.write_text(json.dumps({"systems": {"gb300-nvl72": {"nvme_gbps": {"value": -1, "source": "x"}}}}))
    with pytest.raises(ValueError, match="nvme_gbps=-1"):
        load_catalogue(path)
    path.write_text(json.dumps({"systems": {"x": {"accelerator": "nope"}}}))
    with pytest.raises(ValueError, match="accelerator='nope'"):
        load_catalogue(path)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_catalogue().system("tpu")
    with pytest.raises(ValueError, match="price_per_hour"):
        load_catalogue().system("hgx-h200").with_price(0)
