"""The OpenAI-compatible HTTP server: `tokenmill serve`, or `build_app(ServerState.create(...))`."""
