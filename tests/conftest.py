import os

from hypothesis import settings

# Tests run on the CPU with one device; multi-device tests start subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Hypothesis profiles. "ci" (selected when CI is set, as CI runs with CI=true): the
# examples derive from each test's source, so a CI failure replays on any machine,
# and no example database carries state between runs. "dev": random examples, each
# failure printed with the `@reproduce_failure` blob that replays it. Choose one
# explicitly with `pytest --hypothesis-profile=ci`; `--hypothesis-seed=N` fixes the seed.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
PROFILE = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(PROFILE)


def pytest_report_header(config):
  profile = config.getoption("hypothesis_profile", None) or PROFILE
  return f"hypothesis profile: {profile} (derandomize={settings.default.derandomize})"
