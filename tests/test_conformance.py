"""polyamp's conformance suite (polyamp.conformance.cases) on every backend x device, as pytest tests.

The cases come from the installed package; the `harness` / `harness_pair` fixtures (conftest.py) give
ids like [torch-cpu], skip unavailable frameworks and devices with the reason, and turn a backend's
listed divergences into xfail(strict=True).
"""

from polyamp.conformance.cases import *  # noqa: F403
