"""Shared test settings: under CI (CI=true), hypothesis draws the same examples every run, so a submission's
result does not depend on the seed of the day; locally it keeps exploring new examples."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


#: test files that read the whole measured matrix through memplan.accuracy.compare_rows, whose per-process memo
#: (accuracy.point_peak) then estimates each row once: under pytest-xdist (the README's `-n 2 --dist loadgroup`)
#: they share one worker; every other file is its own group, so its module fixtures are built once
MATRIX_FILES = frozenset({"test_accuracy.py", "test_calibrate.py", "test_lora.py"})


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("matrix" if name in MATRIX_FILES else name))
