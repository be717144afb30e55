"""Server-sent events as the OpenAI API streams them: one `data: <json>` event per chunk, then
`data: [DONE]`. JSON is compact and ASCII-safe (non-ASCII escaped) so an event is one line."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream
MEDIA_TYPE = "text/event-stream"


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def parse_events(raw: bytes) -> list:
    """The JSON payloads of an SSE byte stream, `[DONE]` kept as the string "[DONE]" (tests, bench)."""
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
