"""Constrained answers: tool calls (checked, streamed, run by an agent) and JSON mode. Marker `tools`."""
