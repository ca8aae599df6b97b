"""Registry: lazy names, clear errors, `--set` values checked against config dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engines.base import EngineError
from engines.dummy import DummyConfig, DummyEngine
from engines.registry import build_config, create_engine, engine_class, list_engines, parse_set_options


def test_unknown_engine_lists_valid_names():
    with pytest.raises(EngineError,
                       match=r"unknown engine 'nope'; valid engines: dummy, full, hf, moe, moegen, offload, openai, "
                             r"pagedweight, static-awq, static-gptq, static-rtn"):
        engine_class("nope")


def test_create_engine_coerces_strings():
    engine = create_engine("dummy", {"base_ms": "1.5", "max_num_seqs": "3", "model": "x"})
    assert isinstance(engine, DummyEngine)
    assert engine.config == DummyConfig(model="x", base_ms=1.5, max_num_seqs=3)


@dataclass(frozen=True)
class _Cfg:
    n: int = 1
    x: float | None = None
    flag: bool = False
    name: str = "a"


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({"n": "7"}, _Cfg(n=7)),
        ({"x": "none"}, _Cfg(x=None)),
        ({"x": "0.25"}, _Cfg(x=0.25)),
        ({"flag": "true"}, _Cfg(flag=True)),
        ({"flag": "off"}, _Cfg(flag=False)),
        ({"name": "b", "n": 2}, _Cfg(n=2, name="b")),
    ],
)
def test_build_config(raw, expected):
    assert build_config(_Cfg, raw) == expected


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"m": "1"}, r"has no option 'm'; valid options: n, x, flag, name"),
        ({"n": "1.5"}, r"option 'n' expects int, got '1.5'"),
        ({"flag": "maybe"}, r"option 'flag' expects bool"),
    ],
)
def test_build_config_errors(raw, message):
    with pytest.raises(EngineError, match=message):
        build_config(_Cfg, raw)


def test_parse_set_options():
    assert parse_set_options(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(EngineError, match="key=value"):
        parse_set_options(["novalue"])


def test_listing_has_one_line_each():
    rows = dict(list_engines())
    assert set(rows) == {"dummy", "full", "hf", "moe", "moegen", "offload", "openai", "pagedweight", "static-awq",
                         "static-gptq", "static-rtn"}
    assert all(desc and "\n" not in desc for desc in rows.values())
