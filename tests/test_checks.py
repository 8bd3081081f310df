"""openk3/checks.py: one message shape ("Owner.field=value is invalid: expected ..."), bools are not ints, None passes only
when optional, ranges are closed and named in the message."""

from __future__ import annotations

import math
import re

import pytest

from openk3.checks import check_choice, check_int, check_number, fail


def message(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        call(*args, **kwargs)
    return str(info.value)


def test_fail_names_owner_field_value_and_expectation() -> None:
    assert message(fail, "Owner", "field", "x", "something else") == "Owner.field='x' is invalid: expected something else"
    assert message(fail, "ModelConfig", "kda.num_heads", 0, "a positive integer") == "ModelConfig.kda.num_heads=0 is invalid: expected a positive integer"


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_check_int_accepts_ints_in_range(value: int) -> None:
    check_int("A", "n", value, low=1)
    check_int("A", "n", value)  # no bounds: any int


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, 0, -3])
def test_check_int_refuses_bools_floats_strings_none_and_out_of_range(value: object) -> None:
    assert message(check_int, "A", "n", value, low=1) == f"A.n={value!r} is invalid: expected an integer >= 1"


def test_check_int_ranges_and_their_messages() -> None:
    check_int("A", "n", 4, low=1, high=4)
    check_int("A", "n", 1, low=1, high=4)
    assert message(check_int, "A", "n", 5, low=1, high=4) == "A.n=5 is invalid: expected an integer in [1, 4]"
    assert message(check_int, "A", "n", 0, low=1, high=4) == "A.n=0 is invalid: expected an integer in [1, 4]"
    assert message(check_int, "A", "n", 9, high=8) == "A.n=9 is invalid: expected an integer <= 8"
    assert message(check_int, "A", "n", "x") == "A.n='x' is invalid: expected an integer"


def test_check_int_optional() -> None:
    check_int("A", "n", None, low=1, optional=True)
    check_int("A", "n", 3, low=1, optional=True)
    assert message(check_int, "A", "n", 0, low=1, optional=True) == "A.n=0 is invalid: expected None or an integer >= 1"
    assert message(check_int, "A", "n", True, optional=True) == "A.n=True is invalid: expected None or an integer"
    assert message(check_int, "A", "n", None, low=1) == "A.n=None is invalid: expected an integer >= 1"


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 1.0])
def test_check_number_accepts_ints_and_floats_in_a_closed_range(value: float) -> None:
    check_number("A", "x", value, low=0.0, high=1.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "0.5", None, -0.1, 1.5])
def test_check_number_refuses_non_finite_bools_strings_none_and_out_of_range(value: object) -> None:
    assert message(check_number, "A", "x", value, low=0.0, high=1.0) == f"A.x={value!r} is invalid: expected a finite number in [0.0, 1.0]"


def test_check_number_bounds_and_optional() -> None:
    check_number("A", "x", -1e300)  # no bounds: any finite number
    check_number("A", "x", None, low=0, optional=True)
    assert message(check_number, "A", "x", -1, low=0) == "A.x=-1 is invalid: expected a finite number >= 0"
    assert message(check_number, "A", "x", 3.5, high=2) == "A.x=3.5 is invalid: expected a finite number <= 2"
    assert message(check_number, "A", "x", math.inf, optional=True) == "A.x=inf is invalid: expected None or a finite number"


def test_check_choice() -> None:
    check_choice("A", "k", "b", ("a", "b"))
    check_choice("A", "k", 2, iter([1, 2]))  # any iterable, read once
    assert message(check_choice, "A", "k", "z", ("a", "b")) == "A.k='z' is invalid: expected one of ['a', 'b']"
    assert message(check_choice, "A", "k", None, ["a"]) == "A.k=None is invalid: expected one of ['a']"


def test_checks_imports_only_the_standard_library() -> None:
    import openk3.checks as checks

    source = open(checks.__file__).read()
    imported = set(re.findall(r"^\s*(?:from|import) ([\w.]+)", source, flags=re.M))
    assert imported <= {"__future__", "math", "collections.abc", "typing"}, imported
