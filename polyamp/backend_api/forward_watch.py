"""The forward watch: a backend feeds its framework's layer calls to a `ForwardPass`; which layer produced a non-finite
output is decided here."""

from polyamp._src.forward_watch import (
    LOGGER_NAME,
    ForwardPass,
    ForwardWatchBase,
    WatchedCall,
    check_watch_every,
    forward_report,
    join_dtype_names,
    log_forward_report,
)

__all__ = [
    "LOGGER_NAME",
    "ForwardPass",
    "ForwardWatchBase",
    "WatchedCall",
    "check_watch_every",
    "forward_report",
    "join_dtype_names",
    "log_forward_report",
]
