"""The framework versions polyamp is tested with, the warning a backend gives for an older one, and the import
of a backend's framework that turns its absence into advice."""

from polyamp._src.versions import MINIMUM_VERSIONS, import_framework, warn_if_untested

__all__ = ["MINIMUM_VERSIONS", "import_framework", "warn_if_untested"]
