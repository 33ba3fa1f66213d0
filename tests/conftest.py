import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the suite's worker processes (pytest -n N): one thread each, so
    # that N workers on N cores do not each spin up a pool of N (and what they start inherits it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():  # Triton kernels run in the interpreter; it must be on before they are defined
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI: derandomized, so a red run is reproducible; locally: random, to keep finding new cases.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files instead of comparing")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
