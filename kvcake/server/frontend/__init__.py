"""The HTTP side: the OpenAI API over any `Backend`, its protocol and metrics, and
`LocalBackend` (one engine in this process). Imports nothing else of the server."""
