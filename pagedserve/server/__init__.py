"""The OpenAI-compatible server (app.py: routes; serving.py: completions and chat)."""

# Default limits of `pagedserve serve` (--max-waiting-requests, --max-request-body-bytes).
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024**2
