import pytest

from tests.harness import shutdown_pools

try:
    from hypothesis import settings
except ImportError:  # hypothesis is only needed by the property tests
    pass
else:
    # Examples run on worker pools: the first one waits for a pool to start (seconds), which
    # hypothesis's default 200 ms deadline would report as a flaky failure.
    settings.register_profile("dtensor_lite", deadline=None)
    settings.load_profile("dtensor_lite")


@pytest.fixture(scope="session", autouse=True)
def _harness_pools():
    """Stop the persistent worker pools when the session ends (atexit is the backstop)."""
    yield
    shutdown_pools()


# Tests append human-readable summary lines here (e.g. OpInfo coverage); printed after the run.
SUMMARY_LINES: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if SUMMARY_LINES:
        terminalreporter.section("dtensor_lite coverage")
        for line in SUMMARY_LINES:
            terminalreporter.write_line(line)
