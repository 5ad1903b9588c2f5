"""polyamp's conformance suite (polyamp.conformance.cases) on every backend x device, as pytest tests.

The cases come from the installed package and the ``polyamp`` pytest plugin (installed with it) gives
them their ``harness`` / ``harness_pair`` targets: ids like [torch-cpu], skips with the reason for
unavailable frameworks, devices and capabilities, and xfail(strict=True) for a backend's listed divergences.
"""

from polyamp.conformance.cases import *  # noqa: F403
