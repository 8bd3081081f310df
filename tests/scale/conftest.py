import pytest


def pytest_configure(config: pytest.Config) -> None:
    # until pyproject.toml lists it: tests that start a local Ray cluster (bounded in time, skipped where Ray cannot start)
    config.addinivalue_line("markers", "ray: starts a local Ray cluster (skipped with a reason where Ray cannot start)")
