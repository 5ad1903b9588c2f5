"""Where polyamp's Keras policy classes lived before they moved to ``polyamp_keras``.

Kept so imports of this module keep working (models saved earlier name it as their classes' module, and
importing it registers the classes for loading them).
"""

from __future__ import annotations

from polyamp_keras import PolicyOverridesMap, PolyampDTypePolicy, follow_polyamp_policy, to_keras_policy

__all__ = ["PolicyOverridesMap", "PolyampDTypePolicy", "follow_polyamp_policy", "to_keras_policy"]
