"""Collective interception and call records (the "NCCL hooks")."""

from falconext.trace.hooks import CallTracer
from falconext.trace.records import CallRecord, RecordError, parse_record
from falconext.trace.trap import Trap

__all__ = ["CallRecord", "CallTracer", "RecordError", "Trap", "parse_record"]
