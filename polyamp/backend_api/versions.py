"""The framework versions polyamp is tested with, and the warning a backend gives for an older one."""

from polyamp._src.versions import MINIMUM_VERSIONS, warn_if_untested

__all__ = ["MINIMUM_VERSIONS", "warn_if_untested"]
