"""One worker (an engine, its transfer engine and store node) in its role, and the typed
messages between it and the frontend. Imports nothing else of the server."""
