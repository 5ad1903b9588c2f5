"""The conformance cases as a pytest module: ``pytest --pyargs polyamp.conformance.suite``.

The ``polyamp`` pytest plugin (registered when polyamp is installed) parametrizes them over every backend
with a harness; ``--polyamp-backend`` / ``--polyamp-device`` narrow the targets. See
`polyamp.conformance.pytest_plugin`.
"""

from polyamp.conformance.cases import *  # noqa: F403
