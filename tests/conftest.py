import os

from hypothesis import HealthCheck, settings

# CI: derandomized, so a red run is reproducible; locally: random, to keep finding new cases.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files instead of comparing")
