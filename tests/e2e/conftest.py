"""Fixtures shared by the end-to-end tests."""

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster per test module (about 4 s to start), shut down when the module ends."""
    import ray

    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
