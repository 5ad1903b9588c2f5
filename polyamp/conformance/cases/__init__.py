"""The conformance cases: polyamp's semantics, checked on any backend through its harness.

Every case takes a `Harness` (or, for cross-backend cases, ``harness_pair``) and talks to the framework
only through it; results are compared as NumPy arrays. Run them with ``python -m polyamp.conformance`` or
import them into a pytest module (see tests/test_conformance.py in polyamp's repository).
"""

# The order of these imports is the order cases run and are reported in.
# ruff: noqa: I001, F403
from polyamp.conformance.cases.dtypes import *
from polyamp.conformance.cases.trajectories import *
from polyamp.conformance.cases.iterations import *
from polyamp.conformance.cases.skipping import *
from polyamp.conformance.cases.convergence import *
from polyamp.conformance.cases.float8 import *
