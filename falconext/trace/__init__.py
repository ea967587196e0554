"""Collective interception and call records (the "NCCL hooks")."""

from falconext.trace.records import CallRecord, RecordError, parse_record

__all__ = ["CallRecord", "RecordError", "parse_record"]
