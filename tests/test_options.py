"""Settings declared once (openk3/options.py): the flags of `openk3 serve` / `openk3 generate` come from EngineConfig and
ParallelConfig, a value is refused with the same message whichever way it came, and unknown names are errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from openk3.cli import build_parser
from openk3.launch.flags import add_engine_arguments, engine_configs
from openk3.options import add_arguments, from_args, setting, split_overrides
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig


def parse(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(flags))


def test_defaults_round_trip_and_every_setting_has_a_flag() -> None:
    engine, parallel = engine_configs(parse())
    assert engine == EngineConfig() and parallel == ParallelConfig()
    serve = build_parser().parse_args(["serve"])
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata.get("setting")
        if meta is not None and meta["cli"]:
            assert hasattr(serve, f.name), f.name


def test_units_booleans_and_flag_names() -> None:
    engine, parallel = engine_configs(
        parse(
            "--cache-memory-mb",
            "4",
            "--cpu-offload-gb",
            "0.5",
            "--enable-prefix-caching",
            "--no-cpu-weight-packing",
            "--ep-method",
            "ep",
            "--dtype",
            "bfloat16",
        )
    )
    assert (engine.cache_memory_bytes, engine.cpu_offload_bytes, engine.enable_prefix_caching, engine.pack_cpu_weights) == (4 * 2**20, 2**29, True, False)
    assert engine.dtype == "bfloat16" and parallel.ep_method == "ep"


def test_a_bad_value_reads_the_same_from_a_flag_and_a_keyword() -> None:
    with pytest.raises(ValueError) as from_flag:
        engine_configs(parse("--max-num-seqs", "0"))
    with pytest.raises(ValueError) as from_keyword:
        EngineConfig(max_num_seqs=0)
    assert str(from_flag.value) == str(from_keyword.value) == "EngineConfig.max_num_seqs=0 is invalid: expected an integer >= 1"
    with pytest.raises(ValueError, match=r"ParallelConfig.ep_method='x' is invalid: expected one of \['ep', 'eplb', 'moonep'\]"):
        ParallelConfig(ep_method="x")
    with pytest.raises(ValueError, match="EngineConfig.enable_prefix_caching=1 is invalid: expected True or False"):
        EngineConfig(enable_prefix_caching=1)  # type: ignore[arg-type]  # the check under test


def test_torch_dtypes_and_devices_are_accepted_by_name() -> None:
    import torch

    c = EngineConfig(dtype=torch.bfloat16, device=torch.device("cpu"))  # type: ignore[arg-type]  # LLM(dtype=torch.bfloat16)
    assert (c.dtype, c.device, c.torch_dtype) == ("bfloat16", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="EngineConfig.dtype='float64' is invalid"):
        EngineConfig(dtype="float64")


def test_unknown_overrides_are_named() -> None:
    with pytest.raises(ValueError, match="unknown setting\\(s\\) 'max_num_seq'.*max_num_seqs"):
        split_overrides({"max_num_seq": 3}, EngineConfig, ParallelConfig)
    assert split_overrides({"max_num_seqs": 3, "ep": 2}, EngineConfig, ParallelConfig) == [{"max_num_seqs": 3}, {"ep": 2}]


def test_a_settings_class_of_ones_own() -> None:
    @dataclasses.dataclass(frozen=True)
    class Demo:
        rate: float = setting(0.5, "a rate", low=0.0, high=1.0)
        name: str | None = setting(None, "a name")
        hidden: int = setting(3, "no flag", cli=False)

    p = argparse.ArgumentParser()
    add_arguments(p, Demo)
    args = p.parse_args(["--rate", "0.25", "--name", "x"])
    assert from_args(Demo, args) == Demo(0.25, "x", 3) and not hasattr(args, "hidden")


def test_generate_runs_and_its_seed_is_the_sampling_seed(capsys: pytest.CaptureFixture[str]) -> None:
    from openk3.cli import main

    for extra in ([], ["--seed", "5", "--temperature", "1"]):
        with pytest.warns(UserWarning, match="random weights"):
            assert main(["generate", "--model", "debug", "--prompt", "hi", "--max-tokens", "2", "--cache-memory-mb", "4", "--json", *extra]) == 0
    assert capsys.readouterr().out.count('"finish_reason"') == 2
