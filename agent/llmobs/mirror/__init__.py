"""The traffic mirror (`llmobs-agent mirror`): an HTTP/1.1 reverse proxy for OpenAI-compatible APIs.

Each client request goes to the primary and the primary's response comes back byte for byte; a copy of the
request goes to the shadow through a bounded queue (full: dropped and counted), and both carry one W3C
`traceparent` so the two servers' records pair up by trace id (docs/mirror.md).

Modules, one job each:
  http1        HTTP/1.1 message framing: read a request, read a response head, relay a body as it comes
  traceparent  the W3C traceparent both copies carry (the client's, or a new one)
  upstream     an upstream's address (from its URL) and the keep-alive connection pool to the primary
  shadow       the bounded queue and the workers that send the copies to the shadow and discard the answers
  counters     what the mirror did, printed at exit and served at /llmobs/mirror/stats
  proxy        the server: client connections, forwarding, the 502s, the stats path and a clean stop
"""
