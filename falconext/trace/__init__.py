"""Collective interception and call records (the "NCCL hooks")."""

from falconext.trace.hooks import CallTracer, Trap
from falconext.trace.records import CallRecord, RecordError, parse_record

__all__ = ["CallRecord", "CallTracer", "RecordError", "Trap", "parse_record"]
