"""The REST server: Ollama's API and OpenAI's on one local port. `create_app(client)` in app.py builds it."""
