"""Shared test settings: under CI (CI=true), hypothesis draws the same examples every run, so a submission's
result does not depend on the seed of the day; locally it keeps exploring new examples."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
